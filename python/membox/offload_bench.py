"""membox bench offload: where a model's training state lives, and what it
costs (issue 41; seed 000 COARSE Fig. 16e). The same GPT-style model, data,
batch and Adam for every scheme, W worker processes on this machine:

  ddp            torch DDP over Gloo, torch.optim.Adam on every worker (the
                 whole model, gradients, DDP's buckets and Adam's moments in
                 every worker)
  fsdp2          torch.distributed.fsdp.fully_shard per block and at the
                 root, over Gloo: parameters, gradients and Adam's state
                 sharded over the workers, gathered per block
  fsdp2-offload  the same with CPUOffloadPolicy (skipped with its error
                 where torch refuses it: on CPU modules it has nothing to
                 move)
  membox         membox.torch.offload under `membox launch --nodes N`: the
                 memory nodes hold the weights and Adam's state and step
                 it; a worker holds two blocks ahead (prefetch 2)

Measured, per scheme:

  resident       each worker's peak RSS during training above its RSS
                 before the model was built, per parameter (bytes); membox
                 also reports its own accounting (opt.stats())
  step           median whole-step time (forward, backward, optimizer) of
                 rank 0 after two warm-up steps, and samples/s
  budget         with --budget-mb M: every worker in a memory cgroup of M
                 MiB (v1, /sys/fs/cgroup/memory; needs root), the largest
                 batch (1, 2, 4, ...) each scheme trains for three steps
                 without being OOM-killed, and its samples/s there; on one
                 host or across --topology's hosts

    membox bench offload [--quick] [--csv F] [--json F] [--plot F.png]
                         [--workers 2] [--nodes 2] [--layers 24]
                         [--d-model 640] [--batch 4] [--seq 64]
                         [--budget-mb M] [--repeats R] [--variants a,b]
                         [--min-batch 1] [--max-batch 64]
                         [--device cpu|cuda]

With --device cuda every scheme computes on the GPU (ranks sharing one GPU
use Gloo's CUDA path, a GPU each NCCL): each worker's peak GPU allocation
per parameter is reported too, and --budget-mb caps each worker's GPU
memory (torch.cuda.set_per_process_memory_fraction) instead of a cgroup.

Records follow docs/design/benchmarks.md. The worker is this module with
--worker (an internal flag).
"""
import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ("ddp", "fsdp2", "fsdp2-offload", "membox")
_CGROUP = "/sys/fs/cgroup/memory"


def _die(msg):
    print(f"membox bench offload: {msg}", file=sys.stderr)
    sys.exit(2)


# ------------------------------------------------------------------ worker
def _model(layers, d, vocab, seq):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)
            self.heads = max(1, d // 64)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            shape = (b, t, self.heads, d // self.heads)
            q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(seq, d))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens):
            h = self.emb(tokens) + self.pos[:tokens.shape[1]]
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln(h))

    return GPT()


def _rss():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _cgroup_root():
    """The memory cgroup hierarchy: this machine's, or -- inside an
    emulated host, whose `ip netns exec` mounts a fresh /sys without the
    cgroup file systems -- the same (global) v1 hierarchy mounted again in
    that private mount namespace."""
    if os.path.isdir(_CGROUP):
        return _CGROUP
    root = f"/tmp/membox-memcg-{os.getpid()}"
    os.makedirs(root, exist_ok=True)
    subprocess.run(["mount", "-t", "cgroup", "-o", "memory", "cgroup", root],
                   check=True)
    return root


def _join_cgroup(name, limit_mb):
    path = os.path.join(_cgroup_root(), name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit_mb << 20))
    with open(os.path.join(path, "memory.swappiness"), "w") as f:
        f.write("0")
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    root = os.path.dirname(path)
    if root != _CGROUP:  # mounted here for the join only
        subprocess.run(["umount", root], check=False)
        os.rmdir(root)


def worker(a):
    if a.cgroup:
        _join_cgroup(a.cgroup + "-" + os.environ.get("RANK", "0"),
                     a.budget_mb)
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = a.device == "cuda"
    if cuda:
        # The GPU's budget: the caching allocator refuses beyond it
        # (torch.OutOfMemoryError), as a smaller card would.
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) %
                           torch.cuda.device_count())
        torch.cuda.set_device(dev)
        if a.budget_mb:
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, (a.budget_mb << 20) /
                    torch.cuda.get_device_properties(dev).total_memory))
        # NCCL needs a GPU per rank; ranks sharing one use Gloo's CUDA path.
        backend = "cpu:gloo,cuda:nccl" \
            if torch.cuda.device_count() >= world else "gloo"
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
        backend = "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    vocab = 8192
    rss0 = _rss()["VmRSS"]
    gpu0 = torch.cuda.memory_allocated(dev) if cuda else 0
    torch.manual_seed(0)
    model = _model(a.layers, a.d_model, vocab, a.seq)
    nparams = sum(p.numel() for p in model.parameters())
    if cuda and a.variant != "fsdp2-offload":  # that one places its own
        model = model.to(dev)
    lr = 1e-3
    accounted = None
    if a.variant in ("ddp", "ddp-accum"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    elif a.variant.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        mesh = init_device_mesh(dev.type, (world,))
        kw = {"mesh": mesh}
        if a.variant == "fsdp2-offload":
            kw["offload_policy"] = CPUOffloadPolicy()
        for blk in model.blocks:
            fully_shard(blk, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        import membox.torch as mt
        mt.init()
        opt = mt.offload(model, optimizer="adam", lr=lr,
                         units=list(model.blocks) + [model.emb, model.head],
                         prefetch=a.prefetch)
    # Peak from here: training, not building (membox's build is the full
    # model for a moment, as every scheme's is, before it moves out).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    gen = torch.Generator().manual_seed(100 + rank)
    loss_fn = torch.nn.CrossEntropyLoss()
    times, losses = [], []
    for step in range(a.steps):
        x = torch.randint(0, vocab, (a.batch, a.seq + 1),
                          generator=gen).to(dev)
        t0 = time.perf_counter()
        opt.zero_grad()
        if a.variant == "ddp-accum":
            # The batch in a.accum micro-batches, gradients averaged over
            # them and all-reduced once (DDP's no_sync on all but the last).
            import contextlib
            micro = a.batch // a.accum
            total = 0.0
            for i in range(a.accum):
                part = x[i * micro:(i + 1) * micro]
                ctx = model.no_sync() if i < a.accum - 1 else \
                    contextlib.nullcontext()
                with ctx:
                    lp = loss_fn(model(part[:, :-1]).reshape(-1, vocab),
                                 part[:, 1:].reshape(-1)) / a.accum
                    lp.backward()
                total += float(lp.detach())
            loss = torch.tensor(total)
        else:
            loss = loss_fn(model(x[:, :-1]).reshape(-1, vocab),
                           x[:, 1:].reshape(-1))
            loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if a.variant == "membox" and step == 0:
            opt.stats()
    if a.variant == "membox":
        accounted = opt.stats()["peak_bytes"]
    peak = _rss()["VmHWM"]
    res = {"variant": a.variant, "rank": rank, "params": nparams,
           "resident_bytes": peak - rss0,
           "per_param": (peak - rss0) / nparams,
           "accounted_per_param": (accounted / nparams
                                   if accounted is not None else None),
           "step_s": sorted(times[2:] or times)[len(times[2:] or times) // 2],
           "losses": losses}
    if cuda:  # what the GPU held at its peak, over what it held before
        res["gpu_bytes"] = torch.cuda.max_memory_allocated(dev) - gpu0
        res["gpu_per_param"] = res["gpu_bytes"] / nparams
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver
def _cpu_times():
    """(busy, total) jiffies of the machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return sum(v) - idle, sum(v)


def _cluster(topology, what):
    p = subprocess.run([_membox_bin(), "cluster", what, topology],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    if p.returncode != 0 and what == "up":
        _die("membox cluster up failed: " + p.stdout[-400:])


def _membox_bin():
    import shutil
    return os.environ.get("MEMBOX_BIN") or shutil.which("membox") or "membox"


def run_case(a, variant, batch, out, budget_mb=0, cgroup="", accum=1):
    """One training run of `variant`; its rank 0 record, or None with the
    reason when it failed (OOM: killed by the kernel)."""
    py = sys.executable
    # Under a budget: three steps (the third is timed) per batch tried.
    steps = min(a.steps, 3) if budget_mb else a.steps
    wargs = ["-m", "membox.offload_bench", "--worker", "--variant", variant,
             "--layers", str(a.layers), "--d-model", str(a.d_model),
             "--seq", str(a.seq), "--batch", str(batch),
             "--steps", str(steps), "--prefetch", str(a.prefetch),
             "--device", a.device, "--accum", str(accum), "--out", out]
    if budget_mb:
        wargs += ["--budget-mb", str(budget_mb)]
        if a.device == "cpu":
            wargs += ["--cgroup", cgroup]
    if os.path.exists(out):
        os.unlink(out)
    t0 = time.time()
    cpu0 = _cpu_times()
    if a.topology:  # every variant across the emulated cluster's hosts
        # Fresh memory nodes for every run: the cluster's nodes outlive a
        # job, and a new offload job on them would go on from the last
        # one's model (as a restarted worker set does).
        _cluster(a.topology, "down")
        _cluster(a.topology, "up")
        cmd = [_membox_bin(), "cluster", "run", a.topology, "--", py] + wargs
        p = subprocess.run(cmd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        rcs, log = [p.returncode], p.stdout
    elif variant == "membox":
        cmd = [_membox_bin(), "launch", "--nodes", str(a.nodes), "--workers",
               str(a.workers), "--", py] + wargs
        p = subprocess.run(cmd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        rcs, log = [p.returncode], p.stdout
    else:
        from membox.bench_report import free_port
        port = free_port()
        procs = []
        for r in range(a.workers):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.workers),
                       LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            procs.append(subprocess.Popen([py] + wargs, env=env,
                                          stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        log = ""
        rcs = []
        for p in procs:
            o, _ = p.communicate()
            log += o
            rcs.append(p.returncode)
            if p.returncode != 0:  # the others would wait for it forever
                for q in procs:
                    if q.poll() is None:
                        q.kill()
    wall = time.time() - t0
    cpu1 = _cpu_times()
    busy = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
    if any(rc != 0 for rc in rcs) or not os.path.exists(out):
        oom = any(rc in (-9, 137) for rc in rcs) or "Killed" in log or \
            "exit status -9" in log or "signal 9" in log or \
            "OutOfMemoryError" in log
        return None, ("out of memory" if oom and budget_mb else
                      "failed: " + log.strip().splitlines()[-1][:200]
                      if log.strip() else "failed"), wall
    with open(out) as f:
        rec = json.load(f)
    # The machine's cores busy over the whole run (start-up included):
    # near all of them, the cores and not the links set the time.
    rec["cpu_busy"] = busy * (os.cpu_count() or 1)
    return rec, None, wall


def _remove_cgroups(prefix):
    if not os.path.isdir(_CGROUP):  # a GPU budget made none
        return
    for name in os.listdir(_CGROUP):
        if name.startswith(prefix):
            try:
                os.rmdir(os.path.join(_CGROUP, name))
            except OSError:
                pass


def largest_batch(a, variant, tmp):
    """The largest power-of-two batch `variant` trains under the budget,
    with its record."""
    best = None
    batch = a.min_batch
    cgroup = f"membox-bench-{os.getpid()}"
    while batch <= a.max_batch:
        try:
            rec, why, _ = run_case(a, variant, batch,
                                   os.path.join(tmp,
                                                f"{variant}-b{batch}.json"),
                                   a.budget_mb, cgroup)
        finally:
            _remove_cgroups(cgroup)
        print(f"  budget {a.budget_mb} MiB, {variant} batch {batch}: "
              f"{why or '%.0f ms/step' % (rec['step_s'] * 1e3)}",
              file=sys.stderr, flush=True)
        if rec is None:
            break
        best = (batch, rec)
        batch *= 2
    return best


def main(argv=None):
    from membox.bench_report import bench_parser
    ap = bench_parser("membox bench offload", __doc__, workers=2, nodes=2)
    ap.add_argument("--cgroup", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--d-model", type=int, default=0)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--budget-mb", type=int, default=0)
    ap.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--min-batch", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where every scheme computes; cuda: the GPU's "
                         "peak allocation per parameter too, and "
                         "--budget-mb caps each worker's GPU memory")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--topology", default="", metavar="T.toml",
                    help="run every variant across an emulated cluster "
                         "(`membox cluster`, root): its workers and memory "
                         "hosts; --workers and --nodes come from it")
    ap.add_argument("--replot", default="", metavar="JSON",
                    help="only draw --plot from a run's JSON records")
    a = ap.parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), a.plot or _die("--replot needs --plot"))
        return 0
    a.layers = a.layers or (8 if a.quick else 24)
    a.d_model = a.d_model or (256 if a.quick else 640)
    a.steps = a.steps or (4 if a.quick else 6)
    if a.worker:
        return worker(a)
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            _die(f"unknown variant {v} ({', '.join(VARIANTS)})")
    if a.budget_mb and a.device == "cpu" and not os.access(_CGROUP, os.W_OK):
        _die(f"--budget-mb needs root and memory cgroups ({_CGROUP})")
    if a.topology:
        # (With --budget-mb each worker joins its memory cgroup from inside
        # its host's network namespace: the namespaces share this machine's
        # cgroup file system.)
        import re
        with open(a.topology) as f:
            text = f.read()
        a.workers = int(re.search(r"^workers\s*=\s*(\d+)", text, re.M)[1])
        a.nodes = int(re.search(r"^memory\s*=\s*(\d+)", text, re.M)[1])
        _cluster(a.topology, "down")  # left over from an interrupted run
    repeats = a.repeats or (1 if a.quick else 3)
    import tempfile
    tmp = tempfile.mkdtemp(prefix="membox-offload-bench-")
    from membox.bench_report import run_interleaved
    skipped = {}

    def one(v):
        rec, why, _ = run_case(a, v, a.batch, os.path.join(tmp, v + ".json"))
        if rec is None:
            skipped[v] = why
        return rec
    try:
        res = run_interleaved(variants, repeats, one)
    finally:
        if a.topology:
            _cluster(a.topology, "down")
    rows = {}
    for v, runs in res.items():
        runs = [r for r in runs if r is not None]
        if not runs:
            continue
        runs.sort(key=lambda r: r["step_s"])
        rows[v] = dict(runs[len(runs) // 2],
                       all=[round(r["step_s"] * 1e3) for r in runs])
    if not rows:
        _die("no variant ran: " + "; ".join(f"{v}: {w}"
                                            for v, w in skipped.items()))
    import torch
    nparams = next(iter(rows.values()))["params"]
    print(f"\nGPT-style model, {a.layers} blocks, d={a.d_model}, "
          f"{nparams / 1e6:.1f} M parameters, batch {a.batch} x {a.seq} "
          f"tokens per worker, {a.workers} workers"
          f"{' across ' + a.topology if a.topology else ' on this host'}"
          f"{', on ' + a.device if a.device != 'cpu' else ''}, "
          f"Adam; torch "
          f"{torch.__version__}; median of {repeats} run(s)")
    base = rows.get("ddp")
    print(f"{'variant':14} {'bytes/param':>11} {'(accounted)':>11} "
          f"{'step ms':>8} {'vs ddp':>7} {'vs fsdp2':>8} {'CPU':>5}  last loss"
          f"  runs{'  GPU bytes/param' if a.device == 'cuda' else ''}")
    records = []
    case = f"gpt-{a.layers}x{a.d_model}-b{a.batch}"
    if a.device != "cpu":
        case += "-" + a.device
    if a.topology:
        case += "-" + os.path.basename(a.topology).rsplit(".", 1)[0]
    for v in variants:
        if v not in rows:
            print(f"{v:14} skipped: {skipped.get(v, '?')}")
            continue
        r = rows[v]
        acc = r.get("accounted_per_param")
        vs_ddp = r["step_s"] / base["step_s"] if base else None
        f2 = rows.get("fsdp2")
        vs_f = r["step_s"] / f2["step_s"] if f2 else None
        print(f"{v:14} {r['per_param']:11.2f} "
              f"{(f'{acc:.2f}' if acc is not None else '-'):>11} "
              f"{r['step_s'] * 1e3:8.0f} "
              f"{(f'{vs_ddp:.2f}x' if vs_ddp else '-'):>7} "
              f"{(f'{vs_f:.2f}x' if vs_f else '-'):>8} "
              f"{r['cpu_busy']:5.2f}  "
              f"{r['losses'][-1]:.4f}  {r['all']}"
              f"{'  %.2f' % r['gpu_per_param'] if 'gpu_per_param' in r else ''}")
        metrics = [("resident_bytes_per_param", r["per_param"], "bytes"),
                   ("step_time", r["step_s"], "s"),
                   ("samples_per_s", a.workers * a.batch / r["step_s"],
                    "samples/s"),
                   ("last_loss", r["losses"][-1], "loss"),
                   ("cpu_busy", r["cpu_busy"], "cores")]
        if acc is not None:
            metrics.append(("accounted_bytes_per_param", acc, "bytes"))
        if "gpu_per_param" in r:
            metrics.append(("gpu_bytes_per_param", r["gpu_per_param"],
                            "bytes"))
        if vs_ddp:
            metrics.append(("step_vs_ddp", vs_ddp, "x"))
        if vs_f:
            metrics.append(("step_vs_fsdp2", vs_f, "x"))
        for metric, value, unit in metrics:
            records.append({"bench": "offload", "variant": v,
                            "size_bytes": nparams * 4,
                            "workers": a.workers, "metric": metric,
                            "value": value, "unit": unit, "case": case})
    budget = {}
    if a.budget_mb:
        print(f"\nunder {a.budget_mb} MiB per worker "
              f"({'GPU memory' if a.device == 'cuda' else 'memory cgroup'}):"
              f" largest batch and its samples/s")
        for v in variants:
            if v in skipped:
                continue
            best = largest_batch(a, v, tmp)
            budget[v] = best
        ddp_b = budget.get("ddp")
        mbx_b = budget.get("membox")
        if ddp_b and mbx_b and mbx_b[0] > ddp_b[0]:
            # DDP at its best under the budget, as a user limited by memory
            # would run it: micro-batches (its largest batch, halved until
            # accumulating fits), gradients accumulated to membox's batch
            # and all-reduced once per step.
            micro, rec = ddp_b[0], None
            cgroup = f"membox-bench-{os.getpid()}"
            while micro >= 1 and rec is None:
                k = mbx_b[0] // micro
                try:
                    rec, why, _ = run_case(
                        a, "ddp-accum", mbx_b[0],
                        os.path.join(tmp, "ddp-accum.json"), a.budget_mb,
                        cgroup, accum=k)
                finally:
                    _remove_cgroups(cgroup)
                print(f"  budget {a.budget_mb} MiB, ddp-accum batch "
                      f"{mbx_b[0]} ({k} x {micro}): "
                      f"{why or '%.0f ms/step' % (rec['step_s'] * 1e3)}",
                      file=sys.stderr, flush=True)
                micro //= 2
            budget["ddp-accum"] = (mbx_b[0], rec) if rec else None
        for v, best in budget.items():
            if best is None:
                print(f"{v:14} does not train at batch 1")
                continue
            b, r = best
            sps = a.workers * b / r["step_s"]
            vs = (f"{sps / (a.workers * ddp_b[0] / ddp_b[1]['step_s']):.2f}x "
                  f"ddp" if ddp_b else "")
            print(f"{v:14} batch {b:3d}  {sps:8.2f} samples/s  {vs}")
            for metric, value, unit in (("budget_batch", b, "samples"),
                                        ("budget_samples_per_s", sps,
                                         "samples/s")):
                records.append({"bench": "offload", "variant": v,
                                "size_bytes": nparams * 4,
                                "workers": a.workers, "metric": metric,
                                "value": value, "unit": unit,
                                "case": f"{case}-budget{a.budget_mb}MiB"})
        if a.topology:  # each run brought the cluster up again
            _cluster(a.topology, "down")
    from membox.bench_report import write_records
    write_records(records, a.csv, a.json)
    if a.plot:
        plot(records, a.plot)
    return 0


def plot(records, path):
    """Draws the records of one run (its JSON) into `path` (PNG): bytes per
    parameter, step time, and samples/s under the budget when measured."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by = {}
    for r in records:
        by.setdefault(r["metric"], {})[r["variant"]] = r["value"]
    shown = [v for v in VARIANTS if v in by.get("step_time", {})]
    budget = [v for v in VARIANTS + ("ddp-accum",)
              if v in by.get("budget_samples_per_s", {})]
    n = 3 if budget else 2
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.8))
    colors = {"ddp": "#7f7f7f", "ddp-accum": "#bdbdbd", "fsdp2": "#ff7f0e", "fsdp2-offload": "#ffbb78",
              "membox": "#1f77b4"}
    gpu = "gpu_bytes_per_param" in by
    rss = by["gpu_bytes_per_param" if gpu else "resident_bytes_per_param"]
    acc = by.get("accounted_bytes_per_param", {})
    axes[0].bar(shown, [rss[v] for v in shown],
                color=[colors[v] for v in shown],
                label="GPU peak allocation" if gpu else "peak RSS growth")
    for i, v in enumerate(shown):
        if v in acc:
            axes[0].bar([v], [acc[v]], color="#08306b",
                        label="membox's model state (accounted)")
            axes[0].annotate(f"{acc[v]:.2f}", (i, acc[v]), ha="center",
                             va="bottom", fontsize=8, color="white")
    axes[0].set_ylabel("bytes per parameter (" +
                       ("GPU's peak allocation" if gpu else
                        "peak RSS\nabove pre-model RSS") + ")")
    axes[0].legend(fontsize=7, loc="center right")
    axes[1].bar(shown, [by["step_time"][v] * 1e3 for v in shown],
                color=[colors[v] for v in shown])
    axes[1].set_ylabel("step time, ms (median)")
    if budget:
        sps = by["budget_samples_per_s"]
        axes[2].bar(budget, [sps[v] for v in budget],
                    color=[colors[v] for v in budget])
        for i, v in enumerate(budget):
            axes[2].annotate(f"batch {by['budget_batch'][v]:.0f}",
                             (i, sps[v]), ha="center", va="bottom",
                             fontsize=8)
        case = next(r["case"] for r in records
                    if r["metric"] == "budget_samples_per_s")
        axes[2].set_ylabel("samples/s at the largest batch\n" +
                           case.rsplit("-budget", 1)[-1] + " per worker")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(records[0]["case"] + f", {records[0]['workers']} workers, "
                 "Adam")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
