"""membox launch: start memory nodes and workers on this machine.

    membox launch --nodes 2 --workers 4 -- /usr/bin/python3 train.py ...

Starts N `membox serve` memory nodes whose parameter proxies form one ring,
each with an embedding server (its tables under --checkpoint-dir, or a
temporary directory), then P workers with the rendezvous environment:
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT (for
torch.distributed), MEMBOX_PROXIES, MEMBOX_SECRET_FILE (for
membox.connect) and MEMBOX_EMBEDDING_NODES (for
membox.connect_embeddings). Every output line
is prefixed with its process's role and rank. When a worker fails or a
memory node dies, everything is stopped with a message naming it and the
exit status is non-zero; when all workers succeed, the nodes are stopped
and the status is 0. --checkpoint-dir makes the nodes write checkpoints
there; --resume restarts them from the last one.

With --max-restarts N, a failed worker does not end the job: the launcher
stops the other workers and starts the whole worker set again (up to N
times; MEMBOX_RESTART=k, MEMBOX_RESUMED=1), while the memory nodes keep
running with everything they hold. A job on the explicit parameter server
(membox.torch.ParameterServer) continues from the nodes' current weights,
optimizer state and version -- no disk, no lost round (examples/
train_ps.py resumes at ps.version). A DDP job's weights live in its
workers: it continues from its last membox.torch.save_checkpoint
(load_checkpoint returns it after a restart).

A memory node that dies is replaced (up to --node-replacements times):
with several nodes, every shard is on two nodes (`membox serve
--ps-replicate`, on by default with several nodes), so the launcher starts
a new node on the dead one's ports with `--join` -- it copies the newest
state from the survivors -- while the workers carry on: their parameter
clients keep the dead node's pushes and send them to the replacement, and
the surviving nodes hold their rounds meanwhile (no round lost or
repeated; DDP and the explicit parameter server alike). A single node's
state dies with it: that ends the job as before.

Across hosts, start `membox serve` on the memory hosts yourself and run the
workers with your launcher of choice, letting `membox launch --attach`
translate its environment (mpirun's OMPI_COMM_WORLD_*, Slurm's SLURM_*,
PMI_*) into the one above and exec the command:

    mpirun -np 8 -H a,b membox launch --attach --proxies m1:7301,m2:7301 \
        --secret-file s --master a:29500 -- python3 train.py
"""
import argparse
import collections
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


_given_ports = set()  # handed out by free_port in this process


def free_port():
    """A port for a server the launcher starts later (memory nodes, the
    torch.distributed master). Chosen below the kernel's ephemeral range:
    a port bound to 0 and released could be handed to any outgoing
    connection before the server binds it ("Address already in use"); one
    below the range only to an explicit bind. Never one handed out before
    by this process: the servers bind them later, so a port that is free
    now may already be promised to another node (two nodes of one launch
    were once given the same embedding port)."""
    import random
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, lo))
        if port in _given_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given_ports.add(port)
        return port
    with socket.socket() as s:  # everything below the range is taken
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, role, rank, argv, env, out_lock):
        self.role, self.rank = role, rank
        self.name = f"{role} {rank}"
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  bufsize=1, start_new_session=True)
        self.ready = threading.Event()
        self.lines = collections.deque(maxlen=50)  # the last ones
        self.t = threading.Thread(target=self._pump, args=(out_lock,),
                                  daemon=True)
        self.t.start()

    def _pump(self, lock):
        for line in self.p.stdout:
            line = line.rstrip("\n")
            if "embedding server on" in line:  # printed last by serve
                self.ready.set()
            self.lines.append(line)
            with lock:
                print(f"[{self.name}] {line}", flush=True)

    def stop(self, sig=signal.SIGTERM):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass


def stop_all(procs, grace=10):
    """SIGTERM to every process group, SIGKILL to those still running after
    `grace` seconds; returns when all have exited."""
    for p in procs:
        p.stop()
    deadline = time.time() + grace
    for p in procs:
        try:
            p.p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.stop(signal.SIGKILL)
            p.p.wait()


def _with_package(env):
    """Lets the workers import this membox: a build tree's package goes on
    PYTHONPATH (once); an installed one is found without it."""
    import site
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    installed = set(site.getsitepackages() + [site.getusersitepackages()])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if pkg in installed or pkg in parts:
        return
    env["PYTHONPATH"] = os.pathsep.join([pkg] + parts)


def attach(a, cmd):
    """Worker side of a multi-host launch: rank and size from mpirun, Slurm
    or PMI, memory nodes from --proxies; then exec the command."""
    env = dict(os.environ)
    pairs = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_LOCAL_RANK"),
             ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
             ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))
    for rank, size, local in pairs:
        if rank in env and size in env:
            env["RANK"], env["WORLD_SIZE"] = env[rank], env[size]
            env["LOCAL_RANK"] = env.get(local, "0")
            break
    else:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            sys.exit("membox launch --attach: no rank found (run it under "
                     "mpirun, srun, or set RANK and WORLD_SIZE)")
    if not a.proxies:
        sys.exit("membox launch --attach: --proxies is required")
    env["MEMBOX_PROXIES"] = a.proxies
    if a.embedding_nodes:
        env["MEMBOX_EMBEDDING_NODES"] = a.embedding_nodes
    if a.secret_file:
        env["MEMBOX_SECRET_FILE"] = a.secret_file
    if a.master:
        host, _, port = a.master.rpartition(":")
        env["MASTER_ADDR"], env["MASTER_PORT"] = host, port
    _with_package(env)
    os.execvpe(cmd[0], cmd, env)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="membox launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2, help="memory nodes (0: none)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--membox", default=os.environ.get("MEMBOX_BIN", "membox"),
                    help="the membox binary")
    ap.add_argument("--pool-size", default="64MiB")
    ap.add_argument("--checkpoint-dir", default="")
    ap.add_argument("--resume", action="store_true",
                    help="restart the memory nodes from their last checkpoint "
                    "(none written: they start empty) and tell the workers "
                    "(MEMBOX_RESUMED=1; membox.torch.load_checkpoint)")
    ap.add_argument("--attach", action="store_true",
                    help="multi-host: this process is one worker started by "
                         "mpirun / srun; map its rank and exec the command")
    ap.add_argument("--proxies", default="", help="--attach: memory nodes' "
                    "parameter proxies, host:port,...")
    ap.add_argument("--secret-file", default="", help="--attach: the secret")
    ap.add_argument("--master", default="", help="--attach: MASTER_ADDR:PORT "
                    "for torch.distributed")
    ap.add_argument("--embedding-nodes", default="", help="--attach: the "
                    "memory nodes' embedding servers, host:port,...")
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="restart the worker set this many times when a "
                    "worker fails, or replace a memory node that dies "
                    "(its state copied from the others); the memory nodes "
                    "keep their state")
    ap.add_argument("--ps-replicate", choices=["auto", "on", "off"],
                    default="auto", help="every shard on two nodes, so a "
                    "node can die without losing a round (auto: on with "
                    "several nodes; off saves the backup copies: 1.5-1.9x faster "
                    "syncs on 400 Mbit/s links, docs/results/failures.md, "
                    "but a node's death then ends the job)")
    ap.add_argument("--node-replacements", type=int, default=3,
                    help="with replication: replace a memory node that "
                    "dies this many times (its state copied from the "
                    "others) while the workers carry on")
    ap.add_argument("--emb-budget", default="256MiB",
                    help="memory tier of each embedding table per node")
    ap.add_argument("--emb-push-log", choices=("on", "off"), default="on",
                    help="on: an embedding push is durable when acknowledged "
                    "(logged and synced first); off: at the next flush")
    ap.add_argument("--emb-replicate", choices=("on", "off"), default="on",
                    help="on (with 2+ nodes): each node's embedding rows are "
                    "copied to the next node, so a node whose disk is lost "
                    "takes them back from there and the workers resend what "
                    "the copy did not hold yet (docs/design/embedding.md); "
                    "off: saves the copy's cost (docs/results/failures.md, "
                    "'Durable sparse pushes') and loses the rows of a node "
                    "whose disk is lost")
    ap.add_argument("--emb-backup-lag", default="32MiB",
                    help="bytes of copies a node's backup may lag behind its "
                    "answers (the workers keep those pushes); 0: a push is "
                    "answered once the backup holds its rows")
    ap.add_argument("--node-log-level",
                    default=os.environ.get("MEMBOX_LOG_LEVEL", "warn"),
                    choices=["trace", "debug", "info", "warn", "error", "off"],
                    help="the memory nodes' log level (default: "
                    "MEMBOX_LOG_LEVEL, else warn: failovers and errors)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no worker command given (after --)")
    if a.attach:
        return attach(a, cmd)
    if a.resume and not a.checkpoint_dir:
        ap.error("--resume needs --checkpoint-dir")
    if a.checkpoint_dir:
        try:
            os.makedirs(a.checkpoint_dir, exist_ok=True)
        except OSError as e:
            ap.error(f"--checkpoint-dir {a.checkpoint_dir}: {e.strerror}")
    lock = threading.Lock()

    def say(message):
        """A line of the launcher's own, between the processes' lines."""
        with lock:
            print(f"membox launch: {message}", flush=True)

    tmp = tempfile.mkdtemp(prefix="membox-launch-")
    secret_file = os.path.join(tmp, "secret")
    with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(16) + "\n")
    procs = []

    def shutdown(code, why=None):
        if why:
            say(f"{why}; stopping everything")
        stop_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)  # secret, scratch tables
        return code

    ps_eps = [f"127.0.0.1:{free_port()}" for _ in range(a.nodes)]
    emb_eps = [f"127.0.0.1:{free_port()}" for _ in range(a.nodes)]
    restore = a.resume
    if a.resume:
        # The nodes restore their parameter-server checkpoints; a job that
        # never wrote one (DDP keeps its weights in the workers:
        # membox.torch.save_checkpoint) resumes with empty nodes. Some
        # nodes' checkpoints without the others' is an error.
        have = [os.path.exists(os.path.join(a.checkpoint_dir,
                                            f"proxy-{i}-latest.mbck"))
                for i in range(a.nodes)]
        if any(have) and not all(have):
            missing = [i for i, h in enumerate(have) if not h]
            return shutdown(2, f"--resume: {a.checkpoint_dir} has no "
                               f"checkpoint of node(s) {missing} but has the "
                               f"others' (was the job run with another "
                               f"--nodes?)")
        if not any(have):
            restore = False
            print(f"membox launch: no parameter-server checkpoint in "
                  f"{a.checkpoint_dir}: the nodes start empty; the workers "
                  f"resume from their own (MEMBOX_RESUMED=1)", flush=True)
    replicate = a.nodes > 1 and a.ps_replicate != "off"
    replaced = 0
    node_argv = []

    def start_nodes():
        """Starts the memory nodes on ps_eps / emb_eps; (None, False) once
        all serve, else (why not, whether a port they were given was taken
        by another process before the node bound it: free_port() checks a
        port when it picks it, and another launch on this host may pick and
        bind the same one first)."""
        node_argv.clear()
        started = []
        for i in range(a.nodes):
            argv_n = [a.membox, "--log-level", a.node_log_level, "serve",
                      "--listen", "127.0.0.1:0",
                      "--pool-size", a.pool_size, "--secret-file", secret_file,
                      "--ps-listen", ps_eps[i], "--ps-rank", str(i),
                      "--exit-with-parent"]
            if a.nodes > 1:
                argv_n += ["--ps-peers", ",".join(ps_eps)]
            argv_n += ["--ps-replicate", "on" if replicate else "off"]
            emb_dir = os.path.join(a.checkpoint_dir or tmp, f"embedding-{i}")
            argv_n += ["--emb-listen", emb_eps[i], "--emb-dir", emb_dir,
                       "--emb-budget", a.emb_budget,
                       "--emb-push-log", a.emb_push_log]
            if a.nodes > 1:
                # The job's embedding nodes by place: a hello names the
                # node's, which the workers check against their list.
                argv_n += ["--emb-peers", ",".join(emb_eps)]
            if a.nodes > 1 and a.emb_replicate == "on":
                argv_n += ["--emb-backup", emb_eps[(i + 1) % a.nodes],
                           "--emb-backup-lag", a.emb_backup_lag]
            elif a.nodes > 1:
                argv_n += ["--emb-backup", "off"]
            if a.checkpoint_dir:
                argv_n += ["--checkpoint-dir", a.checkpoint_dir]
            node_argv.append(list(argv_n))
            if restore:
                argv_n += ["--restore"]
            started.append(Proc("node", i, argv_n, dict(os.environ), lock))
            procs.append(started[-1])
        for p in started:
            deadline = time.time() + 30
            while not p.ready.wait(0.1):
                if p.p.poll() is not None or time.time() > deadline:
                    p.t.join(timeout=5)
                    taken = any("Address already in use" in line
                                for line in p.lines)
                    return (f"{p.name} did not start (exit status "
                            f"{p.p.poll()})", taken)
        return None, False

    try:
        for attempt in range(3):
            why, taken = start_nodes()
            if why is None:
                break
            if not taken or attempt == 2:
                return shutdown(1, why)
            say(f"{why}: a port it was given was taken meanwhile; starting "
                f"the memory nodes again on other ports")
            stop_all(procs)
            procs.clear()
            ps_eps[:] = [f"127.0.0.1:{free_port()}" for _ in range(a.nodes)]
            emb_eps[:] = [f"127.0.0.1:{free_port()}" for _ in range(a.nodes)]
        env = dict(os.environ)
        env.update({"WORLD_SIZE": str(a.workers), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(free_port()),
                    "MEMBOX_SECRET_FILE": secret_file,
                    "MEMBOX_PROXIES": ",".join(ps_eps),
                    "MEMBOX_EMBEDDING_NODES": ",".join(emb_eps)})
        if a.checkpoint_dir:
            env["MEMBOX_CHECKPOINT_DIR"] = a.checkpoint_dir
        if a.resume:
            env["MEMBOX_RESUMED"] = "1"
        _with_package(env)
        nodes = procs[:a.nodes]
        workers = []
        restarts = 0

        def start_workers():
            if restarts:
                env["MEMBOX_RESTART"] = str(restarts)
                env["MEMBOX_RESUMED"] = "1"
                env["MASTER_PORT"] = str(free_port())  # the old store may linger
            for r in range(a.workers):
                e = dict(env, RANK=str(r), LOCAL_RANK=str(r))
                w = Proc("worker", r, cmd, e, lock)
                workers.append(w)
                procs.append(w)

        def restart_workers(t0):
            stop_all(workers)
            for x in workers:
                x.t.join(timeout=5)
                procs.remove(x)
            workers.clear()
            start_workers()
            say(f"workers restarted in "
                f"{time.time() - t0:.2f} s")

        def replace_node(n):
            """Starts node n's replacement (--join); None once it serves, or
            why the job must end. While it starts, a second death is
            watched for: that replacement then finds out whether the live
            nodes still hold every shard, and says what was lost if not."""
            nonlocal replaced
            replaced += 1
            t0 = time.time()
            say(f"memory {n.name} died (exit "
                f"status {n.p.returncode}); replacing it from the "
                f"other nodes (replacement {replaced} of "
                f"{a.node_replacements})")
            n.t.join(timeout=5)
            procs.remove(n)
            m = Proc("node", n.rank, node_argv[n.rank] + ["--join"],
                     dict(os.environ), lock)
            procs.append(m)
            nodes[n.rank] = m
            deadline = time.time() + 60
            others = set()
            while not m.ready.wait(0.1):
                for o in nodes:
                    if o is not m and o.p.poll() is not None and \
                            o.rank not in others:
                        others.add(o.rank)
                        say(f"memory {o.name} died "
                            f"too (exit status {o.p.returncode}) "
                            f"before {m.name}'s replacement "
                            f"started")
                if m.p.poll() is not None or time.time() > deadline:
                    m.t.join(timeout=5)
                    said = next((line for line in reversed(m.lines)
                                 if "joining:" in line), "")
                    both = "".join(f" and memory node {r}"
                                   for r in sorted(others))
                    return (f"memory {n.name}{both} died; the replacement "
                            f"of {n.name} "
                            + (f"did not start (exit status {m.p.poll()})"
                               if m.p.poll() is not None else
                               "did not start within 60 s")
                            + (f": {said.strip()}" if said else ""))
            say(f"memory {n.name} replaced in "
                f"{time.time() - t0:.2f} s; the workers carry on")
            return None

        start_workers()
        while True:
            dead = [n for n in nodes if n.p.poll() is not None]
            if dead and replicate and replaced < a.node_replacements and \
                    len(dead) < len(nodes):
                why = replace_node(dead[0])
                if why:
                    return shutdown(1, why)
                continue
            for n in dead:
                say(f"memory {n.name} died (exit "
                    f"status {n.p.returncode}); giving the workers "
                    f"10 s to report it")
                deadline = time.time() + 10
                while time.time() < deadline and any(
                        w.p.poll() is None for w in workers):
                    time.sleep(0.1)
                why = f"memory {n.name} died"
                if not replicate:
                    why += (" (a single node's state dies with it)"
                            if a.nodes == 1 else " (--ps-replicate off)")
                elif replaced >= a.node_replacements:
                    why += (f" (replaced {replaced} time(s) already: "
                            f"--node-replacements)")
                elif len(dead) == len(nodes):
                    why += " (every node is dead: nothing to copy from)"
                return shutdown(1, why)
            failed = [w for w in workers if w.p.poll() not in (None, 0)]
            if failed and restarts < a.max_restarts:
                w = failed[0]
                restarts += 1
                t0 = time.time()
                say(f"{w.name} failed (exit status "
                    f"{w.p.returncode}); restarting the workers "
                    f"(restart {restarts} of {a.max_restarts}); the "
                    f"memory nodes keep their state")
                restart_workers(t0)
                continue
            if failed:
                w = failed[0]
                why = f"{w.name} failed (exit status {w.p.returncode})"
                if a.max_restarts:
                    why += f" after {restarts} restart(s)"
                return shutdown(1, why)
            if all(w.p.poll() == 0 for w in workers):
                for w in workers:
                    w.t.join(timeout=5)
                return shutdown(0)
            time.sleep(0.1)
    except KeyboardInterrupt:
        return shutdown(130, "interrupted")


if __name__ == "__main__":
    sys.exit(main())
