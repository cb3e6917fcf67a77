"""membox cluster: an emulated cluster of hosts on this machine.

    membox cluster up     TOPOLOGY.toml
    membox cluster run    TOPOLOGY.toml [--slots N] -- python3 train.py ...
    membox cluster exec   TOPOLOGY.toml HOST -- CMD ...
    membox cluster status TOPOLOGY.toml
    membox cluster down   TOPOLOGY.toml

Each host is a network namespace with one link (`eth0`, a veth pair) to a
bridge; each link is shaped per direction with tc (token bucket) and, where
the kernel has sch_netem, delayed. Memory hosts run `membox serve` (memory
node, parameter proxy in one ring, embedding server), started by `up` the
way an operator starts it on a real host. Workers are started by `run` the
way users start them across hosts: mpirun over the worker hosts, whose
remote-start agent enters a namespace instead of ssh-ing to a machine, and
`membox launch --attach` on each, which turns mpirun's environment into
RANK / WORLD_SIZE / MASTER_ADDR / MEMBOX_PROXIES ... and execs the command.
`run` on a cluster that is not up brings it up first and takes it down
after (one command creates, uses and removes it); `down` removes
everything, also what a failed `up` or a crashed process left behind.

The topology is a small TOML file (examples/cluster/*.toml):

    name = "demo"          # namespaces mbx-demo-<host>; at most 6 characters
    subnet = "10.81.0"     # hosts get .1 ..; the bridge (this machine) .254
    workers = 4            # worker hosts w0 .. w3
    memory = 2             # memory hosts m0 .. m1 (0: none)
    rate = "1gbit"         # every link, each direction ("": unshaped)
    delay_ms = 0           # one-way delay of every link
    pool = "1GiB"          # each memory node's pool
    standby = 0            # standby hosts s0 ..: `membox serve --standby`,
                           # each takes the place of a memory node that dies
    [host.m1]              # per-host overrides: rate, delay_ms
    rate = "200mbit"

Delays: without sch_netem (this machine's kernel has none) a link's delay
is applied by the workers' link model instead: `run` sets
MEMBOX_PROXY_DELAYS_MS (worker delay + memory host delay per proxy) and
membox's parameter client adds that latency to each operation; MPI and
Gloo traffic is then not delayed (`status` says which applies).

Needs root (network namespaces, veth, tc) and iproute2; says so otherwise.
State (secret, logs, the agent script) lives in /run/membox-cluster/NAME.
"""
import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time

STATE_ROOT = os.environ.get("MEMBOX_CLUSTER_STATE", "/run/membox-cluster")
PS_PORT, MEM_PORT, EMB_PORT = 7310, 7300, 7320
MASTER_PORT = 29500


class ClusterError(Exception):
    pass


def _membox_bin():
    return os.environ.get("MEMBOX_BIN") or shutil.which("membox") or "membox"


# ------------------------------------------------------------------ topology

def _rate_bits(rate):
    """'1gbit' -> 1e9, '200mbit' -> 2e8, '' -> 0 (tc's units)."""
    if not rate:
        return 0
    r = rate.strip().lower()
    units = (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0))
    for suffix, mult in units:
        if r.endswith(suffix):
            try:
                v = float(r[:-len(suffix)])
            except ValueError:
                break
            if v > 0:
                return v * mult
    raise ClusterError(f"bad rate '{rate}' (use e.g. 500mbit, 1gbit)")


def load_topology(path):
    import tomllib
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except OSError as e:
        raise ClusterError(f"cannot read {path}: {e.strerror}")
    except tomllib.TOMLDecodeError as e:
        raise ClusterError(f"{path}: {e}")
    known = {"name", "subnet", "workers", "memory", "rate", "delay_ms", "pool",
             "emb_budget", "host", "sync_cores", "ps_replicate",
             "emb_replicate", "emb_backup_lag",
             "ps_read_window", "standby"}
    extra = set(cfg) - known
    if extra:
        raise ClusterError(f"{path}: unknown keys {sorted(extra)}")
    name = str(cfg.get("name", "mbx"))
    if not (1 <= len(name) <= 6) or not name.isalnum():
        raise ClusterError(f"{path}: name must be 1-6 letters or digits")
    subnet = str(cfg.get("subnet", "10.81.0"))
    parts = subnet.split(".")
    if len(parts) != 3 or not all(p.isdigit() and int(p) < 256 for p in parts):
        raise ClusterError(f"{path}: subnet must be three octets, e.g. 10.81.0")
    nw, nm = int(cfg.get("workers", 2)), int(cfg.get("memory", 1))
    if not (1 <= nw <= 64) or not (0 <= nm <= 64):
        raise ClusterError(f"{path}: 1-64 worker hosts and 0-64 memory hosts")
    ns = cfg.get("standby", 0)
    if not isinstance(ns, int) or isinstance(ns, bool) or not 0 <= ns <= 16:
        raise ClusterError(f"{path}: standby must be a host count, 0-16")
    if ns and (nm < 2 or not cfg.get("ps_replicate", True)):
        raise ClusterError(f"{path}: standby hosts replace memory nodes that "
                           "die, which needs 2+ memory hosts and ps_replicate")
    window = cfg.get("ps_read_window")
    if window is not None and (not isinstance(window, int) or
                               isinstance(window, bool) or window < 0):
        raise ClusterError(f"{path}: ps_read_window must be a shard count >= 0")
    rate = str(cfg.get("rate", ""))
    delay = float(cfg.get("delay_ms", 0))
    overrides = cfg.get("host", {})
    hosts = []
    for role, count, first in (("worker", nw, 1), ("memory", nm, 101),
                               ("standby", ns, 201)):
        for i in range(count):
            hn = f"{role[0]}{i}"
            o = overrides.get(hn, {})
            bad = set(o) - {"rate", "delay_ms"}
            if bad:
                raise ClusterError(f"{path}: host.{hn}: unknown keys {sorted(bad)}")
            h = {"name": hn, "role": role, "index": i,
                 "ip": f"{subnet}.{first + i}", "ns": f"mbx-{name}-{hn}",
                 "veth": f"mbx{name}{hn}"[:15],
                 "rate": str(o.get("rate", rate)),
                 "delay_ms": float(o.get("delay_ms", delay))}
            try:
                _rate_bits(h["rate"])
            except ClusterError as e:
                raise ClusterError(f"{path}: {hn}: {e}")
            if h["delay_ms"] < 0:
                raise ClusterError(f"{path}: negative delay for {hn}")
            hosts.append(h)
    unknown = set(overrides) - {h["name"] for h in hosts}
    if unknown:
        raise ClusterError(f"{path}: [host.X] for hosts not in the topology: "
                           f"{sorted(unknown)}")
    return {"name": name, "subnet": subnet, "hosts": hosts,
            "bridge": f"mbx{name}br"[:15], "pool": str(cfg.get("pool", "1GiB")),
            "emb_budget": str(cfg.get("emb_budget", "256MiB")),
            "sync_cores": int(cfg.get("sync_cores", 1)),
            "ps_replicate": bool(cfg.get("ps_replicate", True)),
            "emb_replicate": bool(cfg.get("emb_replicate", True)),
            "emb_backup_lag": str(cfg.get("emb_backup_lag", "32MiB")),
            "ps_read_window": cfg.get("ps_read_window"),
            "state": os.path.join(STATE_ROOT, name), "source": os.path.abspath(path)}


def workers(topo):
    return [h for h in topo["hosts"] if h["role"] == "worker"]


def memory_hosts(topo):
    return [h for h in topo["hosts"] if h["role"] == "memory"]


def standby_hosts(topo):
    return [h for h in topo["hosts"] if h["role"] == "standby"]


def proxies(topo):
    return ",".join(f"{h['ip']}:{PS_PORT}" for h in memory_hosts(topo))


def embedding_nodes(topo):
    return ",".join(f"{h['ip']}:{EMB_PORT}" for h in memory_hosts(topo))


def secret_file(topo):
    return os.path.join(topo["state"], "secret")


# ------------------------------------------------------------------ plumbing

def _sh(*argv, check=True):
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(argv)}: {p.stderr.strip() or p.returncode}")
    return p


def require_root():
    if os.geteuid() != 0:
        raise ClusterError("membox cluster needs root (it creates network "
                           "namespaces, veth links and tc shapers): run it "
                           "with sudo")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise ClusterError(f"membox cluster needs '{tool}' (apt-get "
                               f"install iproute2)")


def _has_netem():
    probe = f"mbx-netem-{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
        ok = _sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev",
                 "lo", "root", "netem", "delay", "1ms", check=False)
        return ok.returncode == 0
    except ClusterError:
        return False
    finally:
        _sh("ip", "netns", "del", probe, check=False)


def _shape(ns, dev, rate, delay_ms, netem):
    """Egress of `dev` (in namespace `ns`, or this one when None): a token
    bucket at `rate`, behind a netem delay when the kernel has one."""
    pre = ["ip", "netns", "exec", ns] if ns else []
    bits = _rate_bits(rate)
    parent = ["root"]
    if delay_ms > 0 and netem:
        _sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
            "netem", "delay", f"{delay_ms}ms", "limit", "100000")
        parent = ["parent", "1:1"]
    if bits:
        # Burst: 4 ms of traffic (at least 64 KiB) so the bucket, not the
        # timer granularity, sets the rate; 30 ms of queue before drops.
        burst = max(65536, int(bits / 8 * 0.004))
        _sh(*pre, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "10:",
            "tbf", "rate", rate, "burst", str(burst), "latency", "30ms")


def _small_queues(ns, rate):
    """TCP small queues scaled to the emulated link: a socket of host `ns`
    may hold about 1 ms of the link's rate (at least 64 KiB) in its own
    host's queues, as Linux's default (4 MiB: 0.3 ms of a 100 Gbit/s NIC)
    intends for a real NIC. Left at the default, on a 400 Mbit/s token
    bucket one connection could queue 80 ms of data ahead of the host's
    other connections: every scheme with several connections per host
    (membox's one per memory node, Gloo's pair per peer) ran in bursts of
    one peer at a time."""
    bits = _rate_bits(rate)
    if not bits:
        return
    limit = max(65536, int(bits / 8 * 0.001))
    _sh("ip", "netns", "exec", ns, "sysctl", "-qw",
        f"net.ipv4.tcp_limit_output_bytes={limit}")


def _namespaces(prefix):
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.split() and line.split()[0].startswith(prefix)]


def _ipc_file(topo, h):
    return os.path.join(topo["state"], f"{h['name']}.ipc")


def _make_host_ipc(topo, h):
    """The host's own System V IPC namespace, kept by a bind mount at
    _ipc_file(): UCX allocates registered regions as SysV segments, of which
    a kernel has 4096 per IPC namespace -- eight emulated hosts sharing one
    ran out where no real host would. Every process of the host enters it
    (host_argv). False where it cannot be made (then hosts share one)."""
    f = _ipc_file(topo, h)
    open(f, "a").close()
    if _sh("unshare", f"--ipc={f}", "true", check=False).returncode == 0:
        return True
    # A bind mount under a shared mount is refused: make the state
    # directory a private mount of its own (as `ip netns` does /run/netns).
    d = topo["state"]
    if not os.path.ismount(d):
        _sh("mount", "--bind", d, d, check=False)
    _sh("mount", "--make-private", d, check=False)
    return _sh("unshare", f"--ipc={f}", "true", check=False).returncode == 0


def host_argv(topo, h):
    """The prefix that runs a command on host h: its network namespace and,
    where made, its IPC namespace."""
    pre = ["ip", "netns", "exec", h["ns"]]
    if os.path.ismount(_ipc_file(topo, h)):
        pre += ["nsenter", f"--ipc={_ipc_file(topo, h)}"]
    return pre


def _write_agent(topo):
    """mpirun's remote-start agent: `agent HOST CMD...` runs CMD in the
    host's namespace (what ssh does on a real cluster)."""
    path = os.path.join(topo["state"], "agent")
    log = os.path.join(topo["state"], "agent.log")
    cases = "\n".join(
        f"  {h['ip']}|{h['name']}) name={h['name']}; "
        f"enter=\"{' '.join(host_argv(topo, h))}\" ;;" for h in topo["hosts"])
    with open(path, "w") as f:
        f.write("#!/bin/sh\n# membox cluster: mpirun's rsh agent\n"
                "host=$1; shift\ncase $host in\n" + cases +
                "\n  *) echo \"membox cluster agent: unknown host $host\" >&2;"
                " exit 255 ;;\nesac\n"
                f"echo \"$(date +%T.%N) $host: $*\" >>{log}\n"
                # Its own hostname too (a UTS namespace), as a real host has:
                # Open MPI's daemons tell hosts apart by name.
                f"exec $enter unshare --uts /bin/sh -c "
                f"\"hostname $name; $*\" 2>>{log}\n")
    os.chmod(path, 0o755)
    return path


def _read_state(name):
    try:
        with open(os.path.join(STATE_ROOT, name, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_up(topo):
    return _read_state(topo["name"]) is not None


# ------------------------------------------------------------------ up/down

def up(topo, log=print):
    require_root()
    if is_up(topo):
        raise ClusterError(f"cluster '{topo['name']}' is already up "
                           f"(membox cluster down {topo['source']})")
    down(topo, quiet=True)  # leftovers of a crashed run
    st = topo["state"]
    os.makedirs(st, mode=0o700, exist_ok=True)
    try:
        _up(topo, log)
    except BaseException:
        down(topo, quiet=True)
        raise


def _up(topo, log):
    st = topo["state"]
    with open(os.open(secret_file(topo), os.O_WRONLY | os.O_CREAT, 0o600),
              "w") as f:
        f.write(secrets.token_hex(16) + "\n")
    netem = any(h["delay_ms"] > 0 for h in topo["hosts"]) and _has_netem()
    br = topo["bridge"]
    _sh("ip", "link", "add", br, "type", "bridge")
    _sh("ip", "addr", "add", f"{topo['subnet']}.254/24", "dev", br)
    _sh("ip", "link", "set", br, "up")
    for h in topo["hosts"]:
        ns, v, tmp = h["ns"], h["veth"], f"mbxt{os.getpid() % 100000}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", v, "type", "veth", "peer", "name", tmp)
        _sh("ip", "link", "set", tmp, "netns", ns)
        _sh("ip", "-n", ns, "link", "set", tmp, "name", "eth0")
        _sh("ip", "-n", ns, "addr", "add", f"{h['ip']}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "link", "set", v, "master", br, "up")
        _shape(ns, "eth0", h["rate"], h["delay_ms"], netem)  # host -> bridge
        _shape(None, v, h["rate"], h["delay_ms"], netem)     # bridge -> host
        _small_queues(ns, h["rate"])
    for h in topo["hosts"]:
        _make_host_ipc(topo, h)
    state = {"topology": topo, "netem": netem, "nodes": []}
    agent = _write_agent(topo)
    mem = memory_hosts(topo)
    peers = [f"{h['ip']}:{PS_PORT}" for h in mem]
    def emb_backup(h):
        """The embedding nodes of the job, by place, for memory host h or
        a standby (which takes a dead one's place): each node's backup is
        the next one (its rows are copied there; none with one memory
        host), and a standby tells the others where it listens."""
        if len(mem) < 2:
            return []
        argv = ["--emb-peers",
                ",".join(f"{m['ip']}:{EMB_PORT}" for m in mem)]
        if not topo.get("emb_replicate", True):
            return argv + ["--emb-backup", "off"]
        return argv + ["--emb-backup-lag",
                       topo.get("emb_backup_lag", "32MiB")]

    def serve(h, place, standby=False):
        """Starts host h's `membox serve`; `place`: its proxy's flags."""
        d = os.path.join(st, h["name"])
        os.makedirs(d, exist_ok=True)
        argv = host_argv(topo, h) + [
                _membox_bin(), "--log-level", "info", "serve",
                "--listen", f"{h['ip']}:{MEM_PORT}",
                "--pool-size", topo["pool"], "--secret-file", secret_file(topo),
                "--sync-cores", str(topo["sync_cores"]),
                "--ps-listen", f"{h['ip']}:{PS_PORT}"] + place + [
                "--emb-listen", f"{h['ip']}:{EMB_PORT}",
                "--emb-dir", os.path.join(d, "embedding"),
                "--emb-budget", topo["emb_budget"]] + emb_backup(h)
        logf = open(os.path.join(d, "serve.log"), "w")
        p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                             start_new_session=True)
        logf.close()
        state["nodes"].append({"host": h["name"], "pid": p.pid,
                               "log": os.path.join(d, "serve.log"),
                               "standby": standby})

    for h in mem:
        place = ["--ps-rank", str(h["index"])]
        if topo.get("ps_read_window") is not None:
            place += ["--ps-read-window", str(topo["ps_read_window"])]
        if len(peers) > 1:
            place += ["--ps-peers", ",".join(peers), "--ps-replicate",
                      "on" if topo.get("ps_replicate", True) else "off"]
        serve(h, place)
    for h in standby_hosts(topo):
        # Holds nothing until a memory node dies; then it is its
        # replacement, at its own address (docs/design/ps.md).
        serve(h, ["--ps-peers", ",".join(peers), "--standby"], standby=True)
    with open(os.path.join(st, "state.json"), "w") as f:
        json.dump(state, f, indent=1)
    deadline = time.time() + 60
    for n in state["nodes"]:
        while True:
            with open(n["log"]) as f:
                text = f.read()
            if "embedding server on" in text or (
                    n.get("standby") and "it takes the place of" in text):
                break
            if not _alive(n["pid"]) or time.time() > deadline:
                raise ClusterError(f"memory node on {n['host']} did not start:"
                                   f"\n{text[-2000:]}")
            time.sleep(0.1)
    sb = standby_hosts(topo)
    log(f"membox cluster '{topo['name']}' up: {len(workers(topo))} worker "
        f"hosts, {len(mem)} memory hosts"
        + (f" and {len(sb)} standby" if sb else "") +
        f" on {topo['subnet']}.0/24 "
        f"(bridge {br}); links: " + describe_links(topo, netem))
    log(f"  proxies {proxies(topo) or '-'}; agent {agent}")


def describe_links(topo, netem):
    seen = {}
    for h in topo["hosts"]:
        d = h["delay_ms"]
        dd = "" if not d else (f", {d:g} ms" + ("" if netem else
                                                " (link model)"))
        seen.setdefault(f"{h['rate'] or 'unshaped'}{dd}", []).append(h["name"])
    return "; ".join(f"{k}: {','.join(v)}" for k, v in seen.items())


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def down(topo, quiet=False):
    """Stops everything the cluster runs and removes its namespaces, links
    and state; safe to call on a half-made or already removed cluster."""
    require_root()
    state = _read_state(topo["name"]) or {}
    pids = [n["pid"] for n in state.get("nodes", [])]
    prefix = f"mbx-{topo['name']}-"
    spaces = _namespaces(prefix)
    for ns in spaces:  # anything else running inside (workers, strays)
        out = _sh("ip", "netns", "pids", ns, check=False).stdout
        pids += [int(x) for x in out.split() if x.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for pid in pids:  # reap our own children
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    for ns in spaces:
        _sh("ip", "netns", "del", ns, check=False)
    for h in topo["hosts"]:
        _sh("ip", "link", "del", h["veth"], check=False)
    _sh("ip", "link", "del", topo["bridge"], check=False)
    for h in topo["hosts"]:  # the hosts' IPC namespaces go with the mounts
        if os.path.ismount(_ipc_file(topo, h)):
            _sh("umount", _ipc_file(topo, h), check=False)
    if os.path.ismount(topo["state"]):
        _sh("umount", topo["state"], check=False)
    shutil.rmtree(topo["state"], ignore_errors=True)
    if not quiet:
        print(f"membox cluster '{topo['name']}' down "
              f"({len(spaces)} namespaces removed)")


# ------------------------------------------------------------------ running

def mpirun_argv(topo, cmd, slots=1, attach=True, env_names=()):
    """mpirun across the worker hosts. attach: each rank runs
    `membox launch --attach ... -- cmd`; otherwise cmd itself."""
    state = _read_state(topo["name"])
    if state is None:
        raise ClusterError(f"cluster '{topo['name']}' is not up")
    ws = workers(topo)
    subnet = f"{topo['subnet']}.0/24"
    argv = ["mpirun", "--allow-run-as-root", "--bind-to", "none",
            "-np", str(len(ws) * slots),
            "-H", ",".join(f"{h['ip']}:{slots}" for h in ws),
            "--mca", "plm_rsh_agent", os.path.join(topo["state"], "agent"),
            "--mca", "plm_rsh_no_tree_spawn", "1",
            # A daemon that cannot start fails the run instead of hanging it.
            "--mca", "orte_startup_timeout", "30",
            "--mca", "btl", "self,vader,tcp",
            # The emulated hosts share this machine's cores: a rank that
            # waits yields its core instead of spinning (MPI at its best on
            # an oversubscribed machine, and the other processes' due).
            "--mca", "mpi_yield_when_idle", "1",
            "--mca", "btl_tcp_if_include", subnet,
            "--mca", "oob_tcp_if_include", subnet]
    env = worker_env(topo, state)
    os.environ.update(env)
    # MEMBOX_RESTART: a restarted worker set (membox.torch.InMemoryState
    # then restores from the memory nodes).
    for k in sorted(set(env) | set(env_names) |
                    {"PATH", "PYTHONPATH", "MEMBOX_RESTART"}):
        if k in os.environ:
            argv += ["-x", k]
    if attach:
        argv += [_membox_bin(), "launch", "--attach",
                 "--proxies", proxies(topo) or "none",
                 "--secret-file", secret_file(topo),
                 "--master", f"{ws[0]['ip']}:{MASTER_PORT}"]
        if memory_hosts(topo):
            argv += ["--embedding-nodes", embedding_nodes(topo)]
        argv += ["--"]
    return argv + list(cmd)


def worker_env(topo, state):
    """What every worker process needs besides launch --attach's variables:
    the interface for Gloo and UCX, and the link model's delays."""
    env = {"GLOO_SOCKET_IFNAME": "eth0", "UCX_NET_DEVICES": "eth0",
           "MEMBOX_BIN": _membox_bin()}
    ws, mem = workers(topo), memory_hosts(topo)
    if not state.get("netem") and mem:
        d = [ws[0]["delay_ms"] + h["delay_ms"] for h in mem]
        if any(d) and len({h["delay_ms"] for h in ws}) > 1:
            print("membox cluster: warning: worker hosts with different "
                  "delays; the link model uses w0's", file=sys.stderr)
        if any(d):
            env["MEMBOX_PROXY_DELAYS_MS"] = ",".join(f"{x:g}" for x in d)
    return env


def run(topo, cmd, slots=1, keep=False, attach=True):
    require_root()
    created = False
    if not is_up(topo):
        up(topo)
        created = True
    try:
        argv = mpirun_argv(topo, cmd, slots=slots, attach=attach)
        print("membox cluster: " + " ".join(shlex.quote(a) for a in argv),
              flush=True)
        p = subprocess.Popen(argv, start_new_session=True)
        try:
            return p.wait()
        except KeyboardInterrupt:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait()
            return 130
    finally:
        if created and not keep:
            down(topo)


def status(topo):
    state = _read_state(topo["name"])
    if state is None:
        print(f"cluster '{topo['name']}' is down")
        return 1
    print(f"cluster '{topo['name']}': bridge {topo['bridge']} "
          f"{topo['subnet']}.254; delays by "
          f"{'netem' if state['netem'] else 'the workers link model'}")
    for h in topo["hosts"]:
        node = next((n for n in state["nodes"] if n["host"] == h["name"]), None)
        alive = "" if node is None else (
            "  membox serve pid %d %s" % (node["pid"], "running" if
                                          _alive(node["pid"]) else "DEAD"))
        print(f"  {h['name']:4} {h['role']:7} {h['ip']:15} {h['ns']:18} "
              f"{h['rate'] or 'unshaped':>9} {h['delay_ms']:g} ms{alive}")
    code = 0
    for h in memory_hosts(topo):
        p = _sh(*host_argv(topo, h), _membox_bin(), "status",
                "--server", f"{h['ip']}:{MEM_PORT}", "--secret-file",
                secret_file(topo), check=False)
        first = (p.stdout.strip().splitlines() or [p.stderr.strip()])[0]
        print(f"  {h['name']}: {first}")
        code |= p.returncode
    return 1 if code else 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="membox cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["up", "down", "run", "exec", "status"])
    ap.add_argument("topology", help="the topology file (TOML)")
    ap.add_argument("host", nargs="?", help="exec: the host (w0, m1, ...)")
    ap.add_argument("--slots", type=int, default=1,
                    help="run: worker processes per worker host")
    ap.add_argument("--keep", action="store_true",
                    help="run: leave a cluster that run brought up running")
    ap.add_argument("--no-attach", action="store_true",
                    help="run: start the command under mpirun as is, without "
                         "membox launch --attach")
    args = sys.argv[1:] if argv is None else list(argv)
    cmd = []
    if "--" in args:
        i = args.index("--")
        args, cmd = args[:i], args[i + 1:]
    a = ap.parse_args(args)
    try:
        if a.action != "status":
            require_root()
        topo = load_topology(a.topology)
        if a.action == "up":
            up(topo)
            return 0
        if a.action == "down":
            down(topo)
            return 0
        if a.action == "status":
            return status(topo)
        if not cmd:
            ap.error(f"{a.action}: no command given (after --)")
        if a.action == "exec":
            require_root()
            h = next((h for h in topo["hosts"] if h["name"] == a.host), None)
            if h is None:
                ap.error(f"exec: no host '{a.host}' (hosts: "
                         f"{', '.join(x['name'] for x in topo['hosts'])})")
            os.execvp("ip", host_argv(topo, h) + cmd)
        if a.slots < 1:
            ap.error("--slots must be at least 1")
        return run(topo, cmd, slots=a.slots, keep=a.keep,
                   attach=not a.no_attach)
    except ClusterError as e:
        print(f"membox cluster: {e}", file=sys.stderr)
        return 2 if "needs root" in str(e) or "needs '" in str(e) else 1


if __name__ == "__main__":
    sys.exit(main())
