"""membox bench collectives: torch.distributed collectives on the "membox"
backend against Gloo, nccl-tests style, same machine, same run.

    membox bench collectives [--quick] [--csv F] [--json F] [--plot F.png]
                             [--workers 2] [--nodes 1] [--repeats 3]
                             [--sizes 4K,64K,1M,16M,64M]
                             [--ops all_reduce,all_gather,...]
                             [--cluster examples/cluster/4w4m.toml]
                             [--group-size K] [--dtype bfloat16]

For each backend (interleaved --repeats times: drift on a shared machine
hits both alike), --workers processes are started (membox: under `membox
launch --nodes N`; Gloo: with torchrun's environment and no memory node
running; with --cluster, both across the emulated cluster's worker hosts
through mpirun and `membox launch --attach`, the topology's memory nodes
up for both) and time each operation through torch.distributed for each size:
four warm-up calls, then as many as fit in about half a second (at least
three); a call's time is the slowest rank's mean. Reported as nccl-tests
does: size is the bytes of the whole buffer (the output of all_gather, the
input of reduce_scatter), algbw = size / time, busbw = algbw x the
operation's factor (all_reduce 2(p-1)/p; all_gather, reduce_scatter,
all_to_all (p-1)/p; broadcast 1). The table gives the median time and
membox's time over Gloo's (below 1: membox is faster), and each run's CPU
use (user + system seconds of every process it started, per wall second;
the machine's cores are the most; with --cluster the machine's busy cores,
memory nodes included). With --group-size K the job is cut into
subgroups of K consecutive ranks (torch's new_subgroups, as HSDP's
replica groups are), each timing the operations on its own subgroup at
the same time; sizes and bus factors are then per subgroup. Records follow
docs/design/benchmarks.md.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from membox import cluster

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
       "broadcast", "sendrecv")
BACKENDS = ("membox", "gloo")


def _die(msg):
    print(f"membox bench collectives: {msg}", file=sys.stderr)
    sys.exit(2)


def _size(text):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def _bus_factor(op, p):
    if op == "all_reduce":
        return 2 * (p - 1) / p
    if op in ("broadcast", "sendrecv"):
        return 1.0
    return (p - 1) / p


# ------------------------------------------------------------------ worker
def _worker(a):
    import torch
    import torch.distributed as dist
    if a.backend == "membox":
        import membox.torch  # noqa: F401 - registers the backend
    torch.set_num_threads(1)
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    group, p = None, world
    if a.group_size:
        group, _ = dist.new_subgroups(a.group_size)
        p = a.group_size
    me = dist.get_rank(group)

    def peer(q):  # the job rank of group rank q
        return dist.get_global_rank(group, q) if group is not None else q
    results = []
    dtype = getattr(torch, a.dtype)
    esize = torch.empty(0, dtype=dtype).element_size()
    for op in a.ops.split(","):
        for size in (int(s) for s in a.sizes.split(",")):
            n = max(size // esize // p * p, p)  # elements, divisible by p
            full = torch.ones(n, dtype=dtype)
            part = torch.ones(n // p, dtype=dtype)
            if op == "all_reduce":
                def call():
                    dist.all_reduce(full, group=group)
            elif op == "all_gather":
                def call():
                    dist.all_gather_into_tensor(full, part, group=group)
            elif op == "reduce_scatter":
                def call():
                    dist.reduce_scatter_tensor(part, full, group=group)
            elif op == "all_to_all":
                out = torch.empty(n, dtype=dtype)

                def call():
                    dist.all_to_all_single(out, full, group=group)
            elif op == "broadcast":
                def call():
                    dist.broadcast(full, src=peer(0), group=group)
            elif op == "sendrecv":  # nccl-tests' sendrecv: a ring shift
                got = torch.empty(n, dtype=dtype)

                def call():
                    reqs = [dist.isend(full, peer((me + 1) % p), group=group),
                            dist.irecv(got, peer((me - 1) % p), group=group)]
                    for r in reqs:
                        r.wait()
            else:
                raise SystemExit("unknown op %s" % op)
            for _ in range(3):  # warm-up (the split all_reduce's share
                call()          # settles within a few calls)
            t0 = time.perf_counter()
            call()
            # Every rank runs the same number of calls: rank 0's count
            # (about half a second's worth, 3 to 200) decides.
            count = torch.tensor(
                [min(200, max(3, int(0.5 / (time.perf_counter() - t0))))],
                dtype=torch.int64)
            dist.broadcast(count, src=0)
            iters = int(count.item())
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            el = time.perf_counter() - t0
            t = torch.tensor([el / iters], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results.append({"op": op, "size": n * esize, "time_s": t.item(),
                            "iters": iters})
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"world": p, "results": results}, f)
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ driver
from membox.bench_report import children_cpu as _children_cpu  # noqa: E402
from membox.bench_report import free_port as _free_port  # noqa: E402


def _run(a, backend, sizes):
    out = tempfile.mktemp(suffix=".json")
    args = [sys.executable, "-m", "membox.collectives_bench", "--worker",
            "--backend", backend, "--ops", ",".join(a.op_list),
            "--sizes", ",".join(str(s) for s in sizes), "--out", out,
            "--group-size", str(a.group_size), "--dtype", a.dtype]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cpu0, t0 = _children_cpu(), time.perf_counter()
    if a.topo is not None:
        # Across the emulated hosts: mpirun over the worker hosts and
        # `membox launch --attach` on each, for both backends (Gloo ignores
        # the memory nodes; it talks over the same links).
        cmd = cluster.mpirun_argv(a.topo, args, attach=True)
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"),
                                  start_new_session=True)]
    elif backend == "membox":
        cmd = [os.environ.get("MEMBOX_BIN", "membox"), "launch", "--nodes",
               str(a.nodes), "--workers", str(a.workers), "--"] + args
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=env)]
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   WORLD_SIZE=str(a.workers))
        procs = [subprocess.Popen(args, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=dict(env, RANK=str(r),
                                           LOCAL_RANK=str(r)))
                 for r in range(a.workers)]
    if a.topo is not None:
        # Its processes are not this one's children (mpirun's daemons
        # detach): the machine's busy cores, the memory nodes included.
        from membox.cluster_bench import CpuMeter
        with CpuMeter() as meter:
            outs = [p.communicate()[0] for p in procs]
        wall = time.perf_counter() - t0
        cpu = meter.percent / 100 * (os.cpu_count() or 1)
    else:
        outs = [p.communicate()[0] for p in procs]
        wall = time.perf_counter() - t0
        cpu = (_children_cpu() - cpu0) / wall
    if any(p.returncode for p in procs) or not os.path.exists(out):
        sys.stderr.write("\n".join(o[-4000:] for o in outs))
        _die(f"the {backend} run failed")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    res["cpu_per_wall"] = cpu
    return res


def main(argv=None):
    from membox.bench_report import bench_parser
    ap = bench_parser("membox bench collectives", __doc__.split("\n\n")[0],
                      workers=2, nodes=1)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--sizes", default="")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--cluster", default="", metavar="TOPOLOGY",
                    help="run across an emulated cluster (membox cluster's "
                    "topology file; root): one worker per worker host, "
                    "the topology's memory nodes; brought up for the run "
                    "and down after unless it is up already")
    ap.add_argument("--group-size", type=int, default=0, metavar="K",
                    help="time the operations on subgroups of K "
                    "consecutive ranks (new_subgroups), all at once; 0: "
                    "the whole job")
    ap.add_argument("--dtype", default="float32",
                    choices=("float32", "bfloat16", "float16"),
                    help="the tensors' element type (sizes stay bytes)")
    ap.add_argument("--backend", default="membox", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(a)
    a.topo = None
    if a.cluster:
        try:
            cluster.require_root()
            a.topo = cluster.load_topology(a.cluster)
        except cluster.ClusterError as e:
            _die(str(e))
        a.workers = len(cluster.workers(a.topo))
        a.nodes = len(cluster.memory_hosts(a.topo))
        if not a.nodes:
            _die(f"{a.cluster}: the topology has no memory hosts")
    a.op_list = [o for o in a.ops.split(",") if o]
    for o in a.op_list:
        if o not in OPS:
            _die(f"unknown op {o} (one of {', '.join(OPS)})")
    if a.workers < 2:
        _die("--workers must be 2 or more")
    if a.group_size and (a.group_size < 2 or a.workers % a.group_size):
        _die(f"--group-size {a.group_size}: 2 or more, dividing the "
             f"{a.workers} workers")
    sizes = [_size(s) for s in (a.sizes or (
        "4K,1M,16M" if a.quick else "4K,64K,1M,16M,64M")).split(",")]
    repeats = a.repeats or (1 if a.quick else 3)
    try:
        import torch
        from torch._C._distributed_c10d import Backend  # noqa: F401
    except ImportError:
        _die("needs torch 2.x (Python backends) in this interpreter")
    from membox.bench_report import run_interleaved
    created = False
    if a.topo is not None and not cluster.is_up(a.topo):
        try:
            cluster.up(a.topo, log=lambda s: print(s, file=sys.stderr))
        except cluster.ClusterError as e:
            _die(str(e))
        created = True
    try:
        runs = run_interleaved(BACKENDS, repeats,
                               lambda b: _run(a, b, sizes))
    finally:
        if created:
            cluster.down(a.topo, quiet=True)
    where = (f"emulated cluster {os.path.basename(a.cluster)} "
             f"({a.topo['hosts'][0]['rate'] or 'unshaped'} links)"
             if a.topo is not None else "one host")
    p = a.group_size or a.workers
    rows = {}  # (op, size) -> {backend: median time}
    for b, rs in runs.items():
        for i, r0 in enumerate(rs[0]["results"]):
            ts = sorted(r["results"][i]["time_s"] for r in rs)
            rows.setdefault((r0["op"], r0["size"]), {})[b] = ts[len(ts) // 2]
    cpu = {b: sorted(r["cpu_per_wall"] for r in rs)[len(rs) // 2]
           for b, rs in runs.items()}
    groups = (f" in subgroups of {p}" if a.group_size else "")
    print(f"\ntorch.distributed collectives ({a.dtype}), {where}, "
          f"{a.workers} processes{groups}, torch "
          f"{torch.__version__}; membox: {a.nodes} memory node(s); median of "
          f"{repeats} run(s); CPU (cores busy over each whole run): membox "
          f"{cpu['membox']:.2f}, gloo {cpu['gloo']:.2f}")
    print(f"{'op':15} {'size':>10} {'membox ms':>10} {'gloo ms':>9} "
          f"{'membox busbw':>13} {'gloo busbw':>11} {'membox/gloo':>12}")
    records = []
    for (op, size), t in rows.items():
        case = f"{op} in groups of {p}" if a.group_size else op
        if a.dtype != "float32":
            case += f" {a.dtype}"
        f = _bus_factor(op, p)
        bus = {b: size / t[b] * f / 1e9 for b in BACKENDS}
        ratio = t["membox"] / t["gloo"]
        print(f"{op:15} {size:10d} {t['membox'] * 1e3:10.3f} "
              f"{t['gloo'] * 1e3:9.3f} {bus['membox']:10.3f} GB/s "
              f"{bus['gloo']:8.3f} GB/s {ratio:11.2f}x")
        for b in BACKENDS:
            for metric, value, unit in (
                    ("time", t[b], "s"),
                    ("algbw", size / t[b] / 1e9, "GB/s"),
                    ("busbw", bus[b], "GB/s"),
                    ("cpu_per_wall", cpu[b], "cores")):
                records.append({"bench": "collectives", "variant": b,
                                "size_bytes": size, "workers": a.workers,
                                "metric": metric, "value": value,
                                "unit": unit, "case": case})
        records.append({"bench": "collectives", "variant": "membox",
                        "size_bytes": size, "workers": a.workers,
                        "metric": "vs_gloo", "value": ratio, "unit": "x",
                        "case": case})
    from membox.bench_report import write_records
    write_records(records, a.csv, a.json)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for op in a.op_list:
            xs = [s for (o, s) in rows if o == op]
            ax.plot(xs, [rows[(op, s)]["membox"] / rows[(op, s)]["gloo"]
                         for s in xs], marker="o", label=op)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("bytes")
        ax.set_ylabel("membox time / Gloo time (below 1: membox faster)")
        ax.set_title(f"torch.distributed collectives, {a.workers} "
                     f"processes{groups}, "
                     f"{a.nodes} memory node(s), {where}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
