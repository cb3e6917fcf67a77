"""membox bench ctr: the wide & deep CTR model of examples/ctr_wide_deep.py
with its sparse tables in membox's embedding store, against the same model
on torch's own layers and on TorchRec's, same data and seed, same machine.

    membox bench ctr [--quick] [--csv F] [--json F] [--plot F.png]
                     [--samples N] [--repeats R] [--workers 2] [--nodes 2]
                     [--script examples/ctr_wide_deep.py]

Variants (each a separate run of the example, interleaved R times; the
median samples/s is reported):

  torch-local      one process, torch.nn.EmbeddingBag / Embedding with
                   sparse gradients and torch's Adagrad (the reference),
                   as many torch threads as cores (membox's run uses them
                   all)
  torch-ddp        --workers processes (torchrun's environment), each with torch's
                   tables (replicated) and one torch thread, the whole
                   model under DDP with Gloo (sparse gradients all-reduced
                   as sparse tensors): membox's worker count and cores
  torchrec         one process, TorchRec's FusedEmbeddingBagCollection
                   (fbgemm's batched CPU kernels, Adagrad fused into
                   backward), as many threads as cores; skipped with a note when this interpreter
                   cannot import torchrec
  torchrec-dmp     --workers processes (torchrun's environment) with one
                   torch thread each: TorchRec's DistributedModelParallel
                   over Gloo, the tables sharded across the ranks by its
                   planner (ids to their table's rank by all-to-all, Adagrad
                   in backward), the MLP under DDP -- TorchRec's own way to
                   train on membox's worker count and cores; skipped with
                   torchrec
  membox           `membox launch --nodes N --workers W`: tables in the
                   memory nodes, one pull and one push request per node per
                   step for all three tables (membox.torch.EmbeddingGroup),
                   two batches prefetched, the MLP through DDP with
                   membox's hook
  membox-per-table the same with a request per table per node (--no-group:
                   what membox did before grouping)
  membox-1-node    `membox` with one memory node (--nodes 1): three
                   processes on the machine instead of four
  membox-1-worker  one worker and one memory node: on two cores, a core
                   for the worker and one for the node, as torch-local has
                   one core (no DDP round between workers)

Every variant trains the same model on the same click log and reports its
test AUC; the table shows samples/s, the ratios to torch-local and to
torchrec, AUC, and the CPU the run used (user + system seconds of every
process, per wall second: two cores give at most 2.0). All variants run
under this interpreter (MEMBOX_PYTHON picks it: TorchRec's wheels need a
torch of the same release). Records follow docs/design/benchmarks.md.
"""
import json
import os
import subprocess
import sys
import time

VARIANTS = ("torch-local", "torch-ddp", "torchrec", "torchrec-dmp", "membox",
            "membox-per-table", "membox-1-node", "membox-1-worker")
# Variants that run --workers processes with torchrun's environment.
MULTI_PROCESS = ("torch-ddp", "torchrec-dmp")


def _die(msg):
    print(f"membox bench ctr: {msg}", file=sys.stderr)
    sys.exit(2)


def _find_script(path):
    if path:
        if not os.path.isfile(path):
            _die(f"no such script: {path}")
        return path
    here = os.path.dirname(os.path.abspath(__file__))
    for up in range(1, 6):
        root = os.path.normpath(os.path.join(here, *[".."] * up))
        cand = os.path.join(root, "examples", "ctr_wide_deep.py")
        if os.path.isfile(cand):
            return cand
    _die("cannot find examples/ctr_wide_deep.py from the source tree; "
         "pass --script PATH")


from membox.bench_report import children_cpu as _children_cpu  # noqa: E402
from membox.bench_report import free_port as _free_port  # noqa: E402


def run_case(a, variant, script):
    py = sys.executable
    args = ["--samples", str(a.samples), "--seed", str(a.seed)]
    # The one-process baselines get the core budget of membox's run (its
    # workers and nodes use all of this machine's cores): as many torch
    # threads as cores (issue 47; they ran on one thread).
    threads = ["--threads", str(os.cpu_count() or 1)]
    if variant == "torch-local":
        cmd = [py, script, "--local"] + args + threads
    elif variant == "torch-ddp":
        cmd = [py, script, "--ddp"] + args
    elif variant == "torchrec":
        cmd = [py, script, "--torchrec"] + args + threads
    elif variant == "torchrec-dmp":
        cmd = [py, script, "--torchrec", "--dmp"] + args
    else:
        membox_bin = os.environ.get("MEMBOX_BIN", "membox")
        nodes = 1 if variant in ("membox-1-node", "membox-1-worker") \
            else a.nodes
        workers = 1 if variant == "membox-1-worker" else a.workers
        cmd = [membox_bin, "launch", "--nodes", str(nodes), "--workers",
               str(workers), "--", py, script] + args
        if variant == "membox-per-table":
            cmd.append("--no-group")
    # torch-ddp, torchrec-dmp: --workers processes with torchrun's
    # environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, one OpenMP thread
    # each); started here because Debian's torch 1.13 torchrun fails under
    # Python 3.11.
    multi = variant in MULTI_PROCESS
    ranks = a.workers if multi else 1
    env = dict(os.environ, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks),
               OMP_NUM_THREADS="1")
    cpu0, t0 = _children_cpu(), time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))
                              if multi else None)
             for r in range(ranks)]
    outs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - t0
    cpu = (_children_cpu() - cpu0) / wall
    result = None
    for line in outs[0].splitlines():
        if "RESULT " in line:
            result = json.loads(line.split("RESULT ", 1)[1])
    failed = [p.returncode for p in procs if p.returncode != 0]
    if failed or result is None:
        for out in outs:
            sys.stderr.write(out[-6000:])
        _die(f"{variant} failed (exit {failed[0] if failed else 0})")
    result["cpu_per_wall"] = cpu
    return result


def _has_torchrec():
    try:
        import torchrec  # noqa: F401
        import fbgemm_gpu  # noqa: F401
        return True
    except Exception as e:  # ImportError, or fbgemm's OSError on a mismatch
        hint = ("install torchrec and fbgemm-gpu-cpu built for this torch"
                if "nvidia" not in f"{e} {e.__cause__}" else
                "torchrec pulled fbgemm_gpu, the CUDA build, over "
                "fbgemm-gpu-cpu: pip uninstall -y fbgemm_gpu fbgemm_gpu-cpu "
                "&& pip install --no-deps fbgemm-gpu-cpu")
        print(f"membox bench ctr: torchrec skipped ({type(e).__name__}: "
              f"{str(e)[:160]}); {hint}", file=sys.stderr)
        return False


def main(argv=None):
    from membox.bench_report import bench_parser
    ap = bench_parser("membox bench ctr", __doc__, workers=2, nodes=2)
    ap.add_argument("--samples", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--script", default="")
    a = ap.parse_args(argv)
    a.samples = a.samples or (60000 if a.quick else 200000)
    repeats = a.repeats or (1 if a.quick else 3)
    script = _find_script(a.script)
    has_torchrec = _has_torchrec()
    variants = [v for v in VARIANTS
                if not v.startswith("torchrec") or has_torchrec]
    from membox.bench_report import run_interleaved
    res = run_interleaved(variants, repeats, lambda v: run_case(a, v, script))
    from membox.bench_report import median_runs
    rows = median_runs(res, "samples_per_s")
    local = rows["torch-local"]["samples_per_s"]
    trec = rows["torchrec"]["samples_per_s"] if "torchrec" in rows else None
    import torch
    print(f"\nwide & deep CTR, {a.samples} samples, torch {torch.__version__};"
          f" membox: {a.workers} workers, {a.nodes} nodes; median of "
          f"{repeats} run(s)")
    print(f"{'variant':17} {'samples/s':>10} {'vs local':>9} {'vs torchrec':>12}"
          f" {'test AUC':>9} {'CPU':>5}  runs")
    records = []
    for v in variants:
        r = rows[v]
        sps = r["samples_per_s"]
        vs_trec = f"{sps / trec:11.2f}x" if trec else f"{'-':>12}"
        print(f"{v:17} {sps:10.0f} {sps / local:8.2f}x {vs_trec} "
              f"{r['test_auc']:9.4f} {r['cpu_per_wall']:5.2f}  {r['all']}")
        metrics = [("samples_per_s", sps, "samples/s"),
                   ("vs_torch_local", sps / local, "x"),
                   ("test_auc", r["test_auc"], "auc"),
                   ("cpu_per_wall", r["cpu_per_wall"], "cores")]
        if trec:
            metrics.append(("vs_torchrec", sps / trec, "x"))
        for metric, value, unit in metrics:
            records.append({"bench": "ctr", "variant": v,
                            "size_bytes": 0, "workers": r["workers"],
                            "metric": metric, "value": value, "unit": unit,
                            "case": f"wide-deep-{a.samples}"})
    print(f"hidden model's AUC (the ceiling): "
          f"{rows['torch-local']['hidden_model_auc']:.4f}")
    from membox.bench_report import write_records
    write_records(records, a.csv, a.json)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        vals = [rows[v]["samples_per_s"] for v in variants]
        bars = ax.bar(variants, vals,
                      color=["#7f7f7f", "#bcbd22", "#2ca02c", "#98df8a",
                             "#1f77b4", "#aec7e8", "#9467bd",
                             "#17becf"][:len(variants)])
        for b, v in zip(bars, variants):
            ax.annotate(f"AUC {rows[v]['test_auc']:.4f}",
                        (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.tick_params(axis="x", labelrotation=20)
        ax.set_ylabel("training samples/s (median)")
        ax.set_title(f"wide & deep CTR, {a.samples} samples")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
