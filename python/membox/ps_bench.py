"""membox bench ps: the explicit ParameterServer on a model with hundreds of
small tensors -- one key per tensor against fused buckets -- with Gloo DDP
on the same model as the baseline.

    membox bench ps [--quick] [--csv F] [--json F] [--plot F.png]
                    [--workers 2] [--nodes 1] [--layers 200] [--width 32]
                    [--steps N]

The model is a stack of `--layers` Linear(width, width) layers with ReLU:
2 x layers parameter tensors (a weight of width^2 floats and a bias of
width floats each), trained on fixed synthetic data by `--workers`
processes under `membox launch`:

  per-tensor   ParameterServer(bucket_mb=0): every tensor its own key, a
               push/pull round trip each (what ParameterServer did before
               it fused)
  fused        ParameterServer(bucket_mb=4): parameters fused in order into
               ~4 MiB buckets in registered memory, one key per bucket
  gloo-ddp     DDP over Gloo (its own 25 MB buckets) and torch's SGD in the
               worker: the AllReduce a user would otherwise run

Reported: median step time (after warm-up), the ratio to gloo-ddp, and the
final loss (per-tensor and fused must agree exactly: the same sums and the
same SGD on the nodes). Records follow docs/design/benchmarks.md.
"""
import json
import os
import sys
import tempfile
import time

VARIANTS = ("per-tensor", "fused", "gloo-ddp")


def _die(msg):
    print(f"membox bench ps: {msg}", file=sys.stderr)
    sys.exit(2)


def worker(a):
    import torch
    import torch.nn as nn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = int(os.environ["RANK"])
    layers = []
    for _ in range(a.layers):
        layers += [nn.Linear(a.width, a.width), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, a.width, generator=g)
    y = torch.randn(16, a.width, generator=g)
    if a.variant == "gloo-ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step():
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    else:
        import membox.torch as mt
        ps = mt.ParameterServer(model.parameters(), optimizer="sgd", lr=0.01,
                                momentum=0.9,
                                bucket_mb=0 if a.variant == "per-tensor"
                                else 4)

        def step():
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            ps.step()
    times = []
    for _ in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(x), y).item()
    times = sorted(times[a.warmup:])
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_s": times[len(times) // 2], "loss": loss,
                       "tensors": sum(1 for _ in model.parameters()),
                       "param_bytes": sum(p.numel() * p.element_size()
                                          for p in model.parameters())}, f)
    return 0


def run_case(a, variant, tmp):
    out = os.path.join(tmp, f"{variant}.json")
    membox_bin = os.environ.get("MEMBOX_BIN", "membox")
    nodes = 0 if variant == "gloo-ddp" else a.nodes
    cmd = [membox_bin, "launch", "--nodes", str(nodes), "--workers",
           str(a.workers), "--", sys.executable, "-m", "membox.ps_bench",
           "--worker", "--variant", variant, "--layers", str(a.layers),
           "--width", str(a.width), "--steps", str(a.steps), "--warmup",
           str(a.warmup), "--out", out]
    from membox.bench_report import run_launched
    return run_launched(cmd, out, variant, _die)


def main(argv=None):
    from membox.bench_report import bench_parser
    ap = bench_parser("membox bench ps", __doc__, workers=2, nodes=1)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=0,
                    help="runs per variant (median of medians)")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    a.steps = a.steps or (20 if a.quick else 50)
    repeats = a.repeats or (1 if a.quick else 3)
    tmp = tempfile.mkdtemp(prefix="membox-ps-bench-")
    from membox.bench_report import run_interleaved
    res = run_interleaved(VARIANTS, repeats, lambda v: run_case(a, v, tmp))
    from membox.bench_report import median_runs
    rows = median_runs(res, "step_s", scale=1e3, ndigits=2)
    base = rows["gloo-ddp"]["step_s"]
    per = rows["per-tensor"]["step_s"]
    print(f"\n{rows['fused']['tensors']} tensors, "
          f"{rows['fused']['param_bytes'] / 1e6:.2f} MB, {a.workers} workers, "
          f"{a.nodes} node(s), median of {repeats} run(s) x {a.steps} steps")
    print(f"{'variant':11} {'step ms':>8} {'vs gloo':>8} {'vs per-tensor':>14}"
          f" {'loss':>10}  runs (ms)")
    records = []
    for v in VARIANTS:
        r = rows[v]
        print(f"{v:11} {r['step_s'] * 1e3:8.2f} {r['step_s'] / base:7.2f}x "
              f"{r['step_s'] / per:13.2f}x {r['loss']:10.6f}  {r['all']}")
        for metric, value, unit in (("step_ms", r["step_s"] * 1e3, "ms"),
                                    ("vs_gloo", r["step_s"] / base, "x"),
                                    ("final_loss", r["loss"], "loss")):
            records.append({"bench": "ps", "variant": v,
                            "size_bytes": r["param_bytes"],
                            "workers": a.workers, "metric": metric,
                            "value": value, "unit": unit,
                            "case": f"{r['tensors']}-tensors"})
    if rows["fused"]["loss"] != rows["per-tensor"]["loss"]:
        _die("fused and per-tensor training disagree: %r vs %r" %
             (rows["fused"]["loss"], rows["per-tensor"]["loss"]))
    from membox.bench_report import write_records
    write_records(records, a.csv, a.json)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(VARIANTS, [rows[v]["step_s"] * 1e3 for v in VARIANTS],
               color=["#ff7f0e", "#1f77b4", "#d62728"])
        ax.set_ylabel("step time, ms (median)")
        ax.set_title(f"ParameterServer, {rows['fused']['tensors']} tensors, "
                     f"{a.workers} workers, {a.nodes} node(s)")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
