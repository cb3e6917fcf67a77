#!/usr/bin/env python3
"""A real `membox serve` (memory server, parameter proxy, embedding server,
metrics endpoint) against what an attacker on the same network can send
without the secret.

Asserts that the daemon listens on nothing but the ports it was given (no
UCX listener), survives every input of issue 12's findings plus random and
truncated bytes on every port, keeps serving `membox status` while 2,000
idle connections are held, drops them after its deadlines (the metrics
port serves scrapes again then), and exits 0 on SIGTERM afterwards.

Usage: hostile_network_test.py MEMBOX_BIN
"""
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

MEMBOX = sys.argv[1]
IDLE = 2000
PORTS = 4  # memory server, proxy, embedding server, metrics (HTTP)


def scrape(port):
    """GET /metrics; the page, or "" when it cannot be had."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        out = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            out += b
        s.close()
        return out.decode(errors="replace")
    except OSError as e:
        return ""


def free_base_port():
    for _ in range(200):
        base = random.randint(20000, 50000)
        ok = True
        for p in range(base, base + PORTS):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                ok = False
            finally:
                s.close()
        if ok:
            return base
    raise SystemExit("no free ports")


def listening_ports(pid):
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True,
                         check=True).stdout
    ports = set()
    for line in out.splitlines():
        if f"pid={pid}," in line:
            local = line.split()[3]
            ports.add(local)
    return ports


def send(port, data, read=False):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(data)
        if read:
            s.settimeout(2)
            try:
                s.recv(4096)
            except OSError:
                pass
    except OSError:
        pass  # the daemon may close on us: that is allowed
    finally:
        s.close()


def status(secret_file, port, timeout=30):
    t0 = time.time()
    r = subprocess.run([MEMBOX, "status", "--server", f"127.0.0.1:{port}",
                        "--secret-file", secret_file],
                       capture_output=True, text=True, timeout=timeout)
    return r, time.time() - t0


def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < IDLE + 100:
        print(f"skip: RLIMIT_NOFILE hard limit {hard} < {IDLE + 100}")
        return 77
    tmp = tempfile.mkdtemp(prefix="membox-hostile-")
    secret_file = os.path.join(tmp, "secret")
    with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("hostile-network-test-secret-0123456789\r\n")  # CRLF on purpose
    failures = []
    # A port chosen free can be taken before the daemon binds it (other
    # processes' ephemeral ports): start again on other ports, as the
    # benchmark clusters do.
    for attempt in range(5):
        base = free_base_port()
        log = open(os.path.join(tmp, "serve.log"), "w")
        proc = subprocess.Popen(
            [MEMBOX, "serve", "--listen", f"127.0.0.1:{base}", "--pool-size",
             "64MiB", "--secret-file", secret_file, "--emb-dir",
             os.path.join(tmp, "emb"), "--metrics-listen",
             f"127.0.0.1:{base + 3}"], stdout=log, stderr=subprocess.STDOUT)
        up = False
        for _ in range(100):
            if proc.poll() is not None:
                break
            r, _ = status(secret_file, base)
            if r.returncode == 0:
                up = True
                break
            time.sleep(0.2)
        if up:
            break
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
        print(f"daemon did not start on ports {base}..{base + PORTS - 1} "
              f"(attempt {attempt + 1}):\n" +
              open(os.path.join(tmp, "serve.log")).read()[-2000:])
    else:
        raise SystemExit("daemon did not come up")
    try:
        # The memory server answers first; the proxy and the embedding
        # server may still be opening their listeners.
        want = {f"127.0.0.1:{base + i}" for i in range(PORTS)}
        for _ in range(100):
            ports = listening_ports(proc.pid)
            if want <= ports:
                break
            time.sleep(0.1)
        print("listening:", sorted(ports))
        if ports != want:
            failures.append(f"daemon listens on {sorted(ports)}, "
                            f"expected only {sorted(want)}")

        rng = random.Random(12)
        magic = struct.pack("<IH", 0x3142584D, 2)  # handshake version 2
        hello = struct.pack("<I", 38) + magic + bytes(32)
        inputs = [
            b"\xff" * 16,                                   # finding 1
            struct.pack("<QBI", 0xCAFEBABE12345678, 0x20, 0xFFFFFFFF),  # 2
            bytes(rng.getrandbits(8) for _ in range(42)),   # a UCX CM packet
            struct.pack("<I", 0xFFFFFFFF),                  # 4 GiB frame
            hello,                                          # then silence
            hello + struct.pack("<I", 200000),              # oversize proof
            hello + struct.pack("<I", 40) + bytes(40),      # garbage proof
        ]
        inputs += [hello[:n] for n in range(len(hello))]    # truncations
        for size in [1, 2, 3, 5, 8, 13, 64, 100, 1000, 4096, 65536]:
            for _ in range(3):
                inputs.append(bytes(rng.getrandbits(8) for _ in range(size)))
        inputs += [b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\n\r\n",
                   b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n",
                   b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 5000]
        for port in range(base, base + PORTS):
            for data in inputs:
                send(port, data, read=(data is hello))
        if proc.poll() is not None:
            failures.append(f"daemon died on hostile input "
                            f"(exit {proc.returncode})")
        r, _ = status(secret_file, base)
        if r.returncode != 0:
            failures.append("status failed after hostile input: " + r.stderr)
        if "membox_up 1" not in scrape(base + 3):
            failures.append("metrics scrape failed after hostile input")
        print(f"sent {len(inputs)} inputs to each of {PORTS} ports; "
              "daemon alive")

        idle = []
        for i in range(IDLE):
            s = socket.socket()
            s.setblocking(True)
            s.connect(("127.0.0.1", base + i % PORTS))
            idle.append(s)
        print(f"holding {len(idle)} idle connections")
        for attempt in range(3):
            r, took = status(secret_file, base)
            print(f"status while flooded: rc={r.returncode} in {took:.2f} s")
            if r.returncode != 0:
                failures.append("status failed while flooded: " + r.stderr)
            time.sleep(1)
        # Past the handshake deadline (the metrics port: its idle timeout)
        # the idle ones are gone.
        time.sleep(11)
        r, took = status(secret_file, base)
        if r.returncode != 0:
            failures.append("status failed after the flood: " + r.stderr)
        if "membox_up 1" not in scrape(base + 3):
            failures.append("metrics scrape failed after the flood")
        dropped = 0
        for s in idle:
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    dropped += 1
            except BlockingIOError:
                pass
            except OSError:
                dropped += 1
        print(f"{dropped} of {len(idle)} idle connections dropped by the "
              f"daemon after its handshake deadline")
        if dropped < len(idle) * 0.9:
            failures.append(f"only {dropped} idle connections were dropped")
        for s in idle:
            s.close()
        if proc.poll() is not None:
            failures.append(f"daemon died during the flood "
                            f"(exit {proc.returncode})")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        print(f"exit status after SIGTERM: {rc}")
        if rc != 0:
            failures.append(f"daemon exited {rc} on SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    if failures:
        print(open(os.path.join(tmp, "serve.log")).read()[-4000:])
        for f in failures:
            print("FAIL:", f)
        return 1
    print("hostile network test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
