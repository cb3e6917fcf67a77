"""membox bench cluster: membox across hosts on an emulated cluster.

    membox bench cluster [--quick] [--csv F] [--json F] [--plot F.png]
                         [--workers 4] [--rate 400mbit] [--nodes 1,2,4]
                         [--memory-rate R]
                         [--sizes 1MiB,16MiB,...] [--parts allreduce,train]
                         [--repeats N]

Brings up `membox cluster` topologies (worker hosts and memory hosts as
network namespaces, every link shaped to --rate per direction) and measures
on them, with the baselines in the same run:

  allreduce  synchronous PushPull (membox, through 1, 2, 4 memory nodes) vs
             MPI_Allreduce (Open MPI, TCP) and Gloo's all_reduce (torch)
             across the worker hosts, 1 MiB ... 256 MiB, with each scheme's
             link bound in the same table:
               membox: max(n / worker link, p n / (M memory-node link)),
                       or, with fewer nodes than workers, that of the best
                       split of each tensor between the workers' ring and
                       the nodes (split_bound; 0.8x the ring's on 4w2m)
             (--memory-rate: memory hosts' links apart from the workers')
               ring AllReduce: 2 (p - 1) / p  n / worker link
  replication  the default (replicated nodes) against --ps-replicate off:
             PushPull at --sizes, and the transformer example's DDP step
             with the membox hook (examples/transformer_lm.py, 4 blocks of
             width 512, one sequence per worker: the link-bound size)
  train      `membox bench train`'s emulated data-parallel training
             (compute as sleeps, the real model's tensors scaled by
             --model-scale) under DDP's schedule (all buckets reduced, then
             the optimizer step) with MPI and Gloo (DDP's bucketed,
             overlapped AllReduce, bench/train/gloo_train.py), DENSE (one
             node, no COARSE features), membox with M nodes and one node,
             and each COARSE feature off.

Records follow the benchmark contract ({"bench","variant","size_bytes",
"workers","metric","value","unit","case"}); `case` names the topology
("4w2m-400mbit"). Every run also records the machine's CPU use ("cpu",
percent of all cores): a result counts only where the links, not the
cores, were the bottleneck. Needs root (network namespaces).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from membox import cluster

MiB = 1 << 20


def _cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # Niced time counts as idle: background work started with `nice -n 19`
    # (a build, a CI run) does not count against the benchmark's own use.
    idle = v[1] + v[3] + v[4]
    return sum(v), idle


class CpuMeter:
    """Busy share of all cores between start and stop (percent)."""

    def __enter__(self):
        self.t0 = _cpu_times()
        return self

    def __exit__(self, *exc):
        t1 = _cpu_times()
        total, idle = t1[0] - self.t0[0], t1[1] - self.t0[1]
        self.percent = 100.0 * (total - idle) / total if total else 0.0


def _label(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def _size(s):
    s = s.strip()
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if s.endswith(unit):
            return int(float(s[:-3]) * (1 << shift))
    return int(s)


def links(a):
    """The topology's link rates as a case name: "400mbit", or
    "200mbit-m400mbit" when the memory hosts' links differ."""
    if a.memory_rate and a.memory_rate != a.rate:
        return f"{a.rate}-m{a.memory_rate}"
    return a.rate


def topology(name, workers, memory, a, extra=""):
    """Every link at --rate; the memory hosts' at --memory-rate if given."""
    path = os.path.join(tempfile.gettempdir(), f"membox-bench-{name}.toml")
    with open(path, "w") as f:
        f.write(f'name = "{name}"\nsubnet = "10.82.0"\nworkers = {workers}\n'
                f'memory = {memory}\nrate = "{a.rate}"\npool = "{a.pool}"\n'
                f'emb_budget = "16MiB"\n')
        f.write(extra)  # top-level keys come before the [host.X] tables
        if a.memory_rate:
            for i in range(memory):
                f.write(f'[host.m{i}]\nrate = "{a.memory_rate}"\n')
    return cluster.load_topology(path)


def results(proc_out):
    """The fields of every "RESULT ..." line."""
    return [line[7:].split() for line in proc_out.splitlines()
            if line.startswith("RESULT ")]


def mpirun(topo, cmd, attach=False, timeout=900):
    argv = cluster.mpirun_argv(topo, cmd, attach=attach)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
        raise RuntimeError(f"run failed (exit {p.returncode}): {' '.join(cmd[:4])}")
    for line in p.stderr.splitlines():  # what the default decided
        if (line.startswith("  dual sync:") or ": routing S=" in line or
                line.startswith("split")):
            print(line, file=sys.stderr)
    return results(p.stdout)


def gloo_worker(sizes, iters):
    """One rank of the Gloo baseline (started through launch --attach)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    for size in sizes:
        # The check of every scheme (allreduce_bench.cc, RampInput): element
        # i of rank r is (r + 1) * (i mod 4093 + 1); all are compared.
        ramp = (torch.arange(size // 4, dtype=torch.int64) % 4093 + 1).float()
        src = ramp * float(rank + 1)
        t = src.clone()
        times = []
        n = iters if iters > 0 else (3 if size >= 128 * MiB else 6)
        for i in range(n + 1):
            t.copy_(src)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i > 0:
                times.append(dt.item())
        want = ramp * float(world * (world + 1) // 2)
        if not torch.equal(t, want):
            bad = int((t != want).nonzero()[0])
            raise SystemExit("gloo rank %d: wrong sum at element %d of %d" %
                             (rank, bad, size // 4))
        if rank == 0:
            print("RESULT gloo %d %.9f" % (size, statistics.median(times)),
                  flush=True)
    dist.destroy_process_group()


class Records:
    def __init__(self):
        self.rows = []

    def add(self, variant, size, workers, metric, value, unit, case):
        self.rows.append({"bench": "cluster", "variant": variant,
                          "size_bytes": int(size), "workers": workers,
                          "metric": metric, "value": round(value, 6),
                          "unit": unit, "case": case})

    def get(self, variant, size, metric, case):
        for r in self.rows:
            if (r["variant"], r["size_bytes"], r["metric"], r["case"]) == (
                    variant, size, metric, case):
                return r["value"]
        return float("nan")


def split_bound(n, p, m, link, mem_link):
    """The link bound (s) of membox's default sum of n bytes: the best split
    x of the tensor between the workers' ring, which moves 2x(p-1)/p n over
    each worker's link, and the nodes, which move (1-x) n over each
    worker's link and p(1-x) n / m over each node's. Where the nodes have
    as many links as the workers x = 0: max(n / link, p n / (m mem_link))."""
    best = float("inf")
    for i in range(0, 1001):
        x = i / 1000
        worker = (2 * x * (p - 1) / p + (1 - x)) * n / link
        node = p * (1 - x) * n / (m * mem_link)
        best = min(best, max(worker, node))
        if p <= m:
            break  # the nodes alone: what membox does there
    return best


def run_allreduce(a, rec, only=None):
    """PushPull against MPI and Gloo per node count; `only`: the variants
    to run (the replication part: membox's default and --ps-replicate
    off)."""
    membox = cluster._membox_bin()
    p = a.workers
    sizes_s = ",".join(str(s) for s in a.sizes)
    link = cluster._rate_bits(a.rate) / 8  # bytes/s per direction
    mem_link = cluster._rate_bits(a.memory_rate or a.rate) / 8
    python = os.environ.get("MEMBOX_PYTHON", sys.executable)
    for m in a.nodes:
        case = f"{p}w-{links(a)}"  # memory nodes: in the variant names
        topo = topology("bcl", p, m, a)
        cluster.up(topo, log=lambda s: print(s, file=sys.stderr))
        try:
            for n in a.sizes:
                rec.add(f"bound-{m}node", n, p, "time",
                        1e3 * split_bound(n, p, m, link, mem_link), "ms", case)
            peer = [membox, "bench-peer", "allreduce", "worker",
                    cluster.proxies(topo), cluster.secret_file(topo), sizes_s,
                    str(a.iters), str(a.partition)]
            # membox: the default -- the profiler measures the nodes and
            # picks routing, striping and shard sizes; fixed: shards of
            # --partition striped over the nodes (no profile); coarse: seed
            # 000's scheme, each worker through the node next to it
            # (rank % M) and the nodes' ring.
            # Where the nodes have fewer links than the workers the default
            # splits each tensor between the workers' ring and the nodes
            # (sync::SplitAllreduce); "nodes" is the nodes alone.
            runs = [("membox", peer + ["profile"], False),
                    ("fixed", peer + ["stripe"], False)]
            if m < p:
                runs.append(("nodes", peer + ["profile-nodes"], False))
            if m > 1:
                runs.append(("coarse", peer + ["ring"], False))
            if m == a.nodes[0]:
                for n in a.sizes:
                    rec.add("ring-bound", n, p, "time",
                            1e3 * 2 * (p - 1) / p * n / link, "ms", case)
                runs.append(("mpi", [membox, "bench-peer", "allreduce",
                                     "worker", "-", "-", sizes_s,
                                     str(a.iters), "0"], False))
                if not a.no_gloo:
                    runs.append(("gloo", [python, "-m", "membox.cluster_bench",
                                          "--gloo-worker", "--sizes", sizes_s,
                                          "--iters", str(a.iters)], True))
            if m > 1:
                # What node failover costs: the default replicates (each
                # striped shard's owner copies its result to a backup
                # before answering); this variant runs the nodes with
                # --ps-replicate off, one copy of each shard.
                runs.append(("unreplicated", peer + ["profile"], False))
            if only is not None:
                runs = [r for r in runs if r[0] in only]
            # --repeats: every variant once per repeat, the repeats
            # interleaved, so that what the machine does at the time falls
            # on every variant alike; each record is the median over them.
            times, cpus = {}, {}
            for rep in range(a.repeats):
                for variant, cmd, attach in runs:
                    # Fresh nodes: a kept key keeps its first job's shards
                    # and striping (and a repeat's default must not run on
                    # the unreplicated nodes the last variant left).
                    if variant in ("coarse", "fixed", "nodes") or (
                            variant == "membox" and rep > 0):
                        cluster.down(topo, quiet=True)
                        cluster.up(topo, log=lambda s: None)
                    if variant == "unreplicated":
                        cluster.down(topo, quiet=True)
                        cluster.up(topology("bcl", p, m, a,
                                            "ps_replicate = false\n"),
                                   log=lambda s: None)
                    print(f"[{case}] {variant} ..." + (
                        f" (repeat {rep + 1} of {a.repeats})"
                        if a.repeats > 1 else ""), file=sys.stderr, flush=True)
                    with CpuMeter() as cpu:
                        res = mpirun(topo, cmd, attach=attach)
                    if len(res) != len(a.sizes):
                        raise RuntimeError(f"{variant}: {len(res)} of "
                                           f"{len(a.sizes)} results")
                    name = f"{variant}-{m}node" if variant in (
                        "membox", "fixed", "coarse", "nodes",
                        "unreplicated") else variant
                    for _, size, sec in res:
                        times.setdefault((name, int(size)), []).append(
                            float(sec) * 1e3)
                    cpus.setdefault(name, []).append(cpu.percent)
            for (name, size), v in times.items():
                rec.add(name, size, p, "time", statistics.median(v), "ms",
                        case)
                if a.repeats > 1:
                    print(f"  [{case}] {name} {_label(size)}: runs "
                          + ", ".join(f"{x:.1f}" for x in v) + " ms",
                          file=sys.stderr)
            for name, v in cpus.items():
                rec.add(name, 0, p, "cpu", statistics.median(v), "%", case)
        finally:
            cluster.down(topo, quiet=True)


# The transformer example's link-bound size (docs/results/failures.md): one
# sequence per worker, so that the links and not the cores set the step.
TRANSFORMER = ["--d-model", "512", "--layers", "4", "--batch", "1",
               "--steps", "20"]


def _example(name):
    """examples/<name> of the source tree this package was built from."""
    here = os.path.dirname(os.path.abspath(__file__))
    for up in range(1, 6):
        cand = os.path.join(here, *[".."] * up, "examples", name)
        if os.path.isfile(cand):
            return os.path.normpath(cand)
    return None


def _steady_step_ms(text):
    """The mean step of steps 11-20 from the example's "step 10 ... (A
    ms/step)" and "step 20 ... (B ms/step)" lines (each the mean since step
    1): 2B - A."""
    means = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 6 and f[0] == "step" and f[1] in ("10", "20"):
            means[f[1]] = float(f[4].lstrip("("))
    if len(means) != 2:
        return None
    return 2 * means["20"] - means["10"]


def run_transformer_replication(a, rec):
    """The transformer example (examples/transformer_lm.py, DDP with the
    membox hook) on the default's replicated nodes and with --ps-replicate
    off, fresh nodes for every run, the variants interleaved over
    --repeats; the steady-state step (steps 11-20) and the CPU use."""
    script = _example("transformer_lm.py")
    if script is None:
        print("transformer step skipped: examples/transformer_lm.py is not "
              "beside this package (run from the source tree)",
              file=sys.stderr)
        return
    python = os.environ.get("MEMBOX_PYTHON", sys.executable)
    p = a.workers
    for m in a.nodes:
        case = f"transformer@{p}w{m}m-{links(a)}"
        steps, cpus = {}, {}
        for rep in range(a.repeats):
            for variant, extra in (("membox", ""),
                                   ("unreplicated", "ps_replicate = false\n")):
                topo = topology("btf", p, m, a, extra)
                cluster.up(topo, log=lambda s: None)
                try:
                    print(f"[{case}] {variant} ..." + (
                        f" (repeat {rep + 1} of {a.repeats})"
                        if a.repeats > 1 else ""), file=sys.stderr,
                        flush=True)
                    argv = cluster.mpirun_argv(
                        topo, [python, script, "--backend", "membox"] +
                        TRANSFORMER, attach=True)
                    with CpuMeter() as cpu:
                        out = subprocess.run(argv, capture_output=True,
                                             text=True, timeout=900)
                finally:
                    cluster.down(topo, quiet=True)
                ms = _steady_step_ms(out.stdout + out.stderr)
                if out.returncode != 0 or ms is None:
                    sys.stderr.write(out.stdout[-2000:] + out.stderr[-2000:])
                    raise RuntimeError(f"transformer {variant}: failed "
                                       f"(exit {out.returncode})")
                name = f"{variant}-{m}node"
                steps.setdefault(name, []).append(ms)
                cpus.setdefault(name, []).append(cpu.percent)
        for name, v in steps.items():
            rec.add(name, 0, p, "step_time", statistics.median(v), "ms", case)
            rec.add(name, 0, p, "cpu", statistics.median(cpus[name]), "%",
                    case)
        r = statistics.median(steps[f"membox-{m}node"]) / \
            statistics.median(steps[f"unreplicated-{m}node"])
        rec.add(f"replicated-over-unreplicated-{m}node", 0, p, "ratio", r,
                "x", case)
        print(f"\n{case}: transformer step (steps 11-20), ms: replicated "
              + ", ".join(f"{x:.0f}" for x in steps[f"membox-{m}node"])
              + "; --ps-replicate off "
              + ", ".join(f"{x:.0f}" for x in steps[f"unreplicated-{m}node"])
              + f"; replicated / off {r:.2f}; CPU % "
              + ", ".join(f"{k} {statistics.median(v):.0f}"
                          for k, v in cpus.items()))


TRAIN_SCHEMES = [
    # name, nodes (0: MPI or Gloo), routing, partition, dual
    ("mpi", 0, 0, 0, 0),
    ("gloo", 0, 0, 0, 0),
    ("dense", 1, 0, 0, 0),
    ("membox", None, 1, 1, 1),
    ("membox-1node", 1, 1, 1, 1),
    ("membox-no-routing", None, 0, 1, 1),
    ("membox-no-partition", None, 1, 0, 1),
    ("membox-no-dual", None, 1, 1, 0),
]


def gloo_train_cmd(membox, model, a, tmpdir):
    """The Gloo scheme of the emulated training: DDP's bucketed,
    overlapped AllReduce (bench/train/gloo_train.py) with the same scaled
    model and compute times as the C++ schemes, one rank per worker host."""
    out = subprocess.run(
        [membox, "bench-peer", "train", "worker", "scheme=describe",
         f"model={model}", f"scale={a.compute_scale}",
         f"size_scale={a.model_scale}"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    script = out[0].split(" ", 1)[1]
    fwd, bwd, step = out[1].split()[1:]
    layers = os.path.join(tmpdir, f"gloo-{model}.layers")
    with open(layers, "w") as f:
        f.write("\n".join(out[2:]) + "\n")
    python = os.environ.get("MEMBOX_PYTHON", sys.executable)
    return [python, script, "--attached", "--model", layers,
            "--forward-ms", fwd, "--backward-ms", bwd, "--step-ms", step,
            "--iters", str(a.train_iters)]


def run_train(a, rec):
    """Each scheme on fresh memory nodes (a key's shard size and striping
    are fixed by its first declaration) with as many nodes as it uses.
    --repeats: every scheme once per repeat, the repeats interleaved (what
    the machine does at the time falls on every scheme alike); the records
    are the medians, and every scheme's default runs its own profile each
    time, so the spread includes the profile's."""
    membox = cluster._membox_bin()
    p, m = a.workers, max(a.nodes)
    tmpdir = tempfile.mkdtemp(prefix="membox-bench-train-")
    for model in a.models:
        case = f"{model}@{p}w{m}m-{links(a)}"
        runs = {}  # scheme -> [(iteration, blocked, cpu)]
        for rep in range(a.repeats):
            for name, nodes, routing, partition, dual in TRAIN_SCHEMES:
                if name == "gloo" and a.no_gloo:
                    continue
                nodes = m if nodes is None else nodes
                topo = topology("btr", p, max(1, nodes), a)
                cluster.up(topo, log=lambda s: None)
                try:
                    args = [membox, "bench-peer", "train", "worker",
                            f"model={model}", f"iters={a.train_iters}",
                            f"scale={a.compute_scale}",
                            f"size_scale={a.model_scale}"]
                    attach = False
                    if name == "gloo":
                        args = gloo_train_cmd(membox, model, a, tmpdir)
                        attach = True
                    elif nodes == 0:
                        args.append("scheme=mpi")
                    else:
                        args += ["scheme=membox",
                                 "proxies=" + cluster.proxies(topo),
                                 "secret_file=" + cluster.secret_file(topo),
                                 f"routing={routing}",
                                 f"partition={partition}", f"dual={dual}"]
                    print(f"[{case}] {name} ..." + (
                        f" (repeat {rep + 1} of {a.repeats})"
                        if a.repeats > 1 else ""), file=sys.stderr,
                        flush=True)
                    with CpuMeter() as cpu:
                        res = mpirun(topo, args, attach=attach)
                finally:
                    cluster.down(topo, quiet=True)
                if len(res) != 1:
                    raise RuntimeError(f"{name}: no result")
                runs.setdefault(name, []).append(
                    (float(res[0][0]), float(res[0][1]), cpu.percent))
        for name, v in runs.items():
            rec.add(name, 0, p, "iteration",
                    statistics.median(x[0] for x in v), "ms", case)
            rec.add(name, 0, p, "blocked",
                    statistics.median(x[1] for x in v), "ms", case)
            rec.add(name, 0, p, "cpu", statistics.median(x[2] for x in v),
                    "%", case)
            if a.repeats > 1:
                print(f"  [{case}] {name}: iterations "
                      + ", ".join(f"{x[0]:.1f}" for x in v) + " ms",
                      file=sys.stderr)


def print_tables(a, rec):
    cases = sorted({r["case"] for r in rec.rows if r["metric"] == "time"})
    for case in cases:
        nodes = sorted({int(r["variant"].split("-")[1][:-4]) for r in rec.rows
                        if r["case"] == case and
                        r["variant"].startswith("membox-") and
                        r["variant"].endswith("node")})
        print(f"\n{case}: time per synchronous sum (ms), p={a.workers}")
        head = f"{'size':>7} " + " ".join(
            f"{'mbx-%dn' % x:>9}" for x in nodes) + " " + \
            " ".join(f"{'coarse-%dn' % x:>9}" for x in nodes if x > 1) + \
            f" {'mpi':>9} {'gloo':>9} {'bnd-%dn' % nodes[-1]:>9} {'ring-bnd':>9} |" \
            f" {'%dn/bnd' % nodes[-1]:>7} {'%dn/gloo' % nodes[-1]:>8}" \
            f" {'%dn/mpi' % nodes[-1]:>7}"
        print(head)
        for n in a.sizes:
            g = lambda v: rec.get(v, n, "time", case)  # noqa: E731
            mb = [g(f"membox-{x}node") for x in nodes]
            co = [g(f"coarse-{x}node") for x in nodes if x > 1]
            bnd = g(f"bound-{nodes[-1]}node") if nodes else float("nan")
            # The default on this topology: every memory host's node, as
            # the job is given them (never the faster of the variants).
            default = mb[-1] if mb else float("nan")
            print(f"{_label(n):>7} " + " ".join(f"{x:9.2f}" for x in mb) +
                  " " + " ".join(f"{x:9.2f}" for x in co) +
                  f" {g('mpi'):9.2f} {g('gloo'):9.2f} {bnd:9.2f}"
                  f" {g('ring-bound'):9.2f} | {mb[-1] / bnd:7.2f}"
                  f" {default / g('gloo'):8.2f} {default / g('mpi'):7.2f}")
        def against_default(variant, x, title, inverse=False):
            """A line of `variant`'s times with each ratio to the default
            (default / it with `inverse`); nothing when it did not run."""
            t = lambda v, n: rec.get(f"{v}-{x}node", n, "time", case)  # noqa: E731
            if t(variant, a.sizes[0]) != t(variant, a.sizes[0]):  # NaN
                return
            print(f"  {title}, {x} nodes (ms; " + (
                "the default / this" if inverse else "x of the default") +
                "): " + ", ".join(
                    f"{_label(n)} {t(variant, n):.2f} (x" + "%.2f" % (
                        t("membox", n) / t(variant, n) if inverse else
                        t(variant, n) / t("membox", n)) + ")"
                    for n in a.sizes))
        for x in nodes:
            against_default("fixed", x, f"fixed {_label(a.partition)} shards "
                            "striped")
            against_default("nodes", x, "the nodes alone (no split)")
            against_default("unreplicated", x, "--ps-replicate off (the "
                            "default is replicated)", inverse=True)
        cpu = {r["variant"]: r["value"] for r in rec.rows
               if r["case"] == case and r["metric"] == "cpu"}
        print("  CPU use of the runs (% of all cores): " +
              ", ".join(f"{k} {v:.0f}" for k, v in cpu.items()))
    tcases = sorted({r["case"] for r in rec.rows if r["metric"] == "iteration"})
    for case in tcases:
        print(f"\n{case}: iteration / blocked (ms), CPU %")
        it = {r["variant"]: r["value"] for r in rec.rows
              if r["case"] == case and r["metric"] == "iteration"}
        for v, t in it.items():
            b = rec.get(v, 0, "blocked", case)
            c = rec.get(v, 0, "cpu", case)
            print(f"  {v:22} {t:9.1f} {b:9.1f} {c:5.0f}%   "
                  f"x{t / it.get('mpi', float('nan')):.2f} of MPI, "
                  f"x{t / it.get('dense', float('nan')):.2f} of DENSE")


def write(a, rec):
    from membox.bench_report import write_records
    write_records(rec.rows, a.csv, a.json)
    if a.plot:
        plot(a, rec)


def plot(a, rec):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = sorted({r["case"] for r in rec.rows if r["metric"] == "time"})
    tcases = sorted({r["case"] for r in rec.rows if r["metric"] == "iteration"})
    fcases = sorted({r["case"] for r in rec.rows if r["metric"] == "step_time"})
    panels = len(cases) + (1 if tcases else 0) + (1 if fcases else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        variants = []
        for r in rec.rows:
            if r["case"] == case and r["metric"] == "time" and \
                    r["variant"] not in variants:
                variants.append(r["variant"])
        for v in variants:
            pts = sorted((r["size_bytes"], r["value"]) for r in rec.rows
                         if r["case"] == case and r["metric"] == "time" and
                         r["variant"] == v)
            style = ":" if "bound" in v else "-"
            ax.plot([x for x, _ in pts], [y for _, y in pts], style,
                    marker="" if style == ":" else "o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(a.sizes)
        ax.set_xticklabels([_label(s) for s in a.sizes], fontsize=7)
        ax.set_xlabel("tensor size")
        ax.set_ylabel("time per sum (ms)")
        ax.set_title(case)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if fcases:  # the transformer step, replicated against not
        ax = axes[0][len(cases)]
        for i, (v, label) in enumerate((("membox", "replicated (default)"),
                                        ("unreplicated",
                                         "--ps-replicate off"))):
            ys = [next((r["value"] for r in rec.rows if r["case"] == c and
                        r["metric"] == "step_time" and
                        r["variant"].startswith(v + "-")), float("nan"))
                  for c in fcases]
            ax.bar([j + i * 0.4 for j in range(len(fcases))], ys, 0.4,
                   label=label)
        for j, c in enumerate(fcases):
            ratio = next((r["value"] for r in rec.rows if r["case"] == c and
                          r["metric"] == "ratio"), None)
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (j + 0.2, 0), ha="center",
                            va="bottom", fontsize=8)
        ax.set_xticks([j + 0.2 for j in range(len(fcases))])
        ax.set_xticklabels([c.split("@")[1] for c in fcases], fontsize=7)
        ax.set_ylabel("transformer step (ms)")
        ax.set_title("transformer_lm.py, DDP + membox hook")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    if tcases:
        ax = axes[0][-1]
        names = [s[0] for s in TRAIN_SCHEMES]
        width = 0.8 / len(names)
        for i, v in enumerate(names):
            ys = [rec.get(v, 0, "iteration", c) for c in tcases]
            ax.bar([j + i * width for j in range(len(tcases))], ys, width,
                   label=v)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tcases))])
        ax.set_xticklabels([c.split("@")[0] for c in tcases])
        ax.set_ylabel("iteration (ms)")
        ax.set_title("emulated training @ " + tcases[0].split("@")[1])
        ax.legend(fontsize=7, ncol=2)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("membox bench cluster (emulated hosts, shaped links)")
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="membox bench cluster",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from membox.bench_report import add_contract_flags
    add_contract_flags(ap)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default="400mbit",
                    help="every host link, per direction")
    ap.add_argument("--memory-rate", default="",
                    help="the memory hosts' links, per direction (default: "
                         "--rate)")
    ap.add_argument("--nodes", default="", help="memory nodes, e.g. 1,2,4")
    ap.add_argument("--sizes", default="")
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="every variant (allreduce) or scheme (train) this "
                         "many times, interleaved; records are the medians")
    ap.add_argument("--partition", default="4MiB",
                    help="membox shard size")
    ap.add_argument("--pool", default="2GiB")
    ap.add_argument("--parts", default="allreduce,train",
                    help="allreduce, train, replication (the default's "
                    "PushPull and the transformer example's DDP step "
                    "against --ps-replicate off only)")
    ap.add_argument("--models", default="")
    ap.add_argument("--model-scale", type=float, default=0.0,
                    help="train: fraction of each model's tensor bytes")
    ap.add_argument("--compute-scale", type=float, default=0.0,
                    help="train: fraction of each model's compute time")
    ap.add_argument("--train-iters", type=int, default=0)
    ap.add_argument("--variants", default="",
                    help="allreduce: run only these variants (membox, "
                    "fixed, nodes, coarse, unreplicated, mpi, gloo)")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--gloo-worker", action="store_true",
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.sizes = [_size(s) for s in a.sizes.split(",")] if a.sizes else (
        [1 * MiB, 16 * MiB, 64 * MiB] if a.quick else
        [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB])
    if a.gloo_worker:
        gloo_worker(a.sizes, a.iters)
        return 0
    a.nodes = [int(x) for x in a.nodes.split(",")] if a.nodes else (
        [1, 2] if a.quick else [1, 2, 4])
    a.partition = _size(a.partition)
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    if a.iters == 0 and a.quick:
        a.iters = 3
    a.models = a.models.split(",") if a.models else (
        ["resnet50"] if a.quick else ["resnet50", "vgg16", "bert-large"])
    a.model_scale = a.model_scale or (0.1 if a.quick else 0.25)
    a.compute_scale = a.compute_scale or a.model_scale
    # 2 warm-up iterations, then at least 3 measured (quick included)
    a.train_iters = a.train_iters or (5 if a.quick else 6)
    parts = set(a.parts.split(","))
    try:
        cluster.require_root()
    except cluster.ClusterError as e:
        print(f"membox bench cluster: {e}", file=sys.stderr)
        return 77
    rec = Records()
    t0 = time.time()
    try:
        if "allreduce" in parts:
            run_allreduce(a, rec, only=tuple(a.variants.split(","))
                          if a.variants else None)
        elif "replication" in parts:
            # What replication (the default with 2+ nodes) costs: the
            # default against --ps-replicate off, nothing else.
            a.nodes = [m for m in a.nodes if m > 1] or [2]
            run_allreduce(a, rec, only=("membox", "unreplicated"))
            run_transformer_replication(a, rec)
        if "train" in parts:
            run_train(a, rec)
    finally:  # what was measured is kept even when a later part fails
        if rec.rows:
            print_tables(a, rec)
            write(a, rec)
    print(f"\n({time.time() - t0:.0f} s; ratios < 1: membox faster or "
          f"within the bound factor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
