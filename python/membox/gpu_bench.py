"""membox bench gpu: CUDA training through membox against Gloo, on one GPU.

    membox bench gpu [--quick] [--csv F] [--json F] [--plot F.png]
                     [--models resnet50,bert] [--workers 2] [--nodes 1,2]
                     [--iters N] [--batch N] [--wire bfloat16|float16|none]

Each case trains a real model (torchvision's ResNet-50; a BERT-base masked
language model from transformers, or torch's own TransformerEncoder where
transformers is missing) with DDP in --workers processes that share the
machine's GPU, CUDA tensors and a Gloo process group, started by
`membox launch`:

  gloo         DDP's AllReduce over Gloo (Gloo stages CUDA tensors itself)
  membox-N     membox.torch.allreduce_hook: each bucket copied into
               page-locked registered host memory on a side stream, summed by
               N memory nodes (`membox serve` on this host's CPUs), copied
               back on another stream
  membox-N-bf16  the same hook with init(wire_dtype="bfloat16"): each
               bucket rounded to bfloat16 on the GPU, so half the bytes
               cross PCIe and reach the nodes (--wire; float32 sums there)
  gloo-bf16    Gloo with torch's bf16_compress_hook (fp16_compress_hook for
               --wire float16): the baseline with the same wire dtype
  compute      the same loop under DDP's no_sync(): no communication, the
               floor every scheme is measured against

Reported per case: iteration time, blocked time (iteration - compute floor),
the final loss (every scheme trains the same model on the same data), and for
membox the rate its staging copies achieved during training and, measured in
the same worker right after, the staging buffer's copy rate against a
page-locked torch buffer's (the PCIe copy rate of this machine).
Records follow the benchmark contract (docs/design/benchmarks.md).
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

BUCKET_MB = 25  # DDP's default bucket cap


def _die(msg):
    print(f"membox bench gpu: {msg}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------- models

def build_model(name, batch, device):
    """(model, inputs, loss_fn(out) -> scalar) with fixed synthetic data."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(1234 + int(
        os.environ.get("RANK", 0)))
    if name == "resnet50":
        import torchvision
        model = torchvision.models.resnet50(weights=None)
        x = torch.randn(batch, 3, 224, 224, generator=g).to(device)
        y = torch.randint(0, 1000, (batch,), generator=g).to(device)
        return model, (x,), lambda out: torch.nn.functional.cross_entropy(
            out, y)
    if name == "bert":
        seq = 128
        try:
            from transformers import BertConfig, BertForMaskedLM
            cfg = BertConfig()  # bert-base-uncased's shape, random weights
            model = BertForMaskedLM(cfg)
            ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
            labels = ids.clone()
            ids, labels = ids.to(device), labels.to(device)
            return model, (ids,), lambda out: torch.nn.functional.cross_entropy(
                out.logits.view(-1, cfg.vocab_size), labels.view(-1))
        except ImportError:
            layer = torch.nn.TransformerEncoderLayer(768, 12, 3072,
                                                     batch_first=True)
            model = torch.nn.TransformerEncoder(layer, 12)
            x = torch.randn(batch, seq, 768, generator=g).to(device)
            return model, (x,), lambda out: out.pow(2).mean()
    if name == "mlp":  # small and exact: the tests' model
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10))
        x = torch.randn(batch, 256, generator=g).to(device)
        y = torch.randint(0, 10, (batch,), generator=g).to(device)
        return model, (x,), lambda out: torch.nn.functional.cross_entropy(
            out, y)
    _die(f"unknown model {name!r} (resnet50, bert, mlp)")


# ----------------------------------------------------------------- worker

def copy_rates(staging_buffer, nbytes, device, reps=20):
    """GB/s of device<->host copies of `nbytes` into the membox staging
    buffer (registered + page-locked) and into a torch page-locked buffer,
    timed with CUDA events on a side stream."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    s = torch.cuda.Stream(device)
    for name, host in (("staging", staging_buffer[:nbytes]),
                       ("pinned", pinned)):
        for d in ("d2h", "h2d"):
            with torch.cuda.stream(s):
                for _ in range(3):
                    (host.copy_(src, non_blocking=True) if d == "d2h"
                     else src.copy_(host, non_blocking=True))
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record(s)
                for _ in range(reps):
                    (host.copy_(src, non_blocking=True) if d == "d2h"
                     else src.copy_(host, non_blocking=True))
                b.record(s)
            b.synchronize()
            out[f"{name}_{d}_gbps"] = nbytes * reps / (a.elapsed_time(b) / 1e3) / 1e9
    return out


def worker(a):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not torch.cuda.is_available():
        _die("no CUDA device")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))
                       % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank
    model, inputs, loss_fn = build_model(a.model, a.batch, dev)
    model = model.to(dev)
    ddp = DDP(model, device_ids=[dev.index], bucket_cap_mb=BUCKET_MB)
    membox_torch = None
    if a.scheme == "membox":
        import membox.torch as membox_torch
        membox_torch.init(wire_dtype=a.wire or None)
        ddp.register_comm_hook(None, membox_torch.allreduce_hook)
    elif a.scheme == "gloo" and a.wire:
        # The same wire dtype for the baseline (issue 47): torch's own
        # compression hooks, as a DDP user halves Gloo's bytes.
        from torch.distributed.algorithms.ddp_comm_hooks import \
            default_hooks
        hook = {"bfloat16": default_hooks.bf16_compress_hook,
                "float16": default_hooks.fp16_compress_hook}[a.wire]
        ddp.register_comm_hook(dist.group.WORLD, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    losses, times = [], []
    for it in range(a.warmup + a.iters):
        if it == a.warmup and membox_torch is not None:
            membox_torch.staging_stats(timing=True)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        sync = ddp.no_sync() if a.scheme == "compute" \
            else contextlib.nullcontext()
        with sync:
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(ddp(*inputs))
            loss.backward()
        opt.step()
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    result = {"rank": rank, "scheme": a.scheme, "model": a.model,
              "params": sum(p.numel() for p in model.parameters()),
              "param_bytes": sum(p.numel() * p.element_size()
                                 for p in model.parameters()),
              "iter_s": sorted(times[a.warmup:])[len(times[a.warmup:]) // 2],
              "iter_mean_s": sum(times[a.warmup:]) / len(times[a.warmup:]),
              "losses": losses}
    if membox_torch is not None:
        st = membox_torch.staging_stats(timing=False)
        result["train_d2h_gbps"] = st["d2h"]["gbps"]
        result["train_h2d_gbps"] = st["h2d"]["gbps"]
        result["staged_bytes"] = st["d2h"]["bytes"]
        dist.barrier()  # the other workers are idle while rank 0 measures
        if rank == 0:
            from membox.torch.staging import staging_for
            staging = staging_for(membox_torch.client())
            nbytes = BUCKET_MB << 20
            arr, host = staging.buffer(("gpu_bench", nbytes), nbytes)
            result.update(copy_rates(host, nbytes, dev))
        dist.barrier()
    dist.barrier()
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


# ----------------------------------------------------------------- driver

def run_case(a, model, scheme, nodes, tmp, wire=""):
    out = os.path.join(tmp, f"{model}-{scheme}-{nodes}{wire}.json")
    membox_bin = os.environ.get("MEMBOX_BIN", "membox")
    cmd = [membox_bin, "launch", "--nodes", str(nodes if scheme == "membox"
                                               else 0),
           "--workers", str(a.workers), "--pool-size", "1GiB", "--",
           sys.executable, "-m", "membox.gpu_bench", "--worker",
           "--scheme", scheme, "--model", model, "--iters", str(a.iters),
           "--warmup", str(a.warmup), "--batch", str(a.batch[model]),
           "--lr", str(a.lr), "--out", out, "--wire", wire or "none"]
    t0 = time.time()
    from membox.bench_report import run_launched
    r = run_launched(cmd, out, f"{model} {scheme}", _die)
    r["wall_s"] = time.time() - t0
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(prog="membox bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer iterations, one node count")
    ap.add_argument("--csv", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--nodes", default="", help="memory-node counts "
                    "(default 1,2; --quick 1)")
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--batch", default="", help="model=batch,... "
                    "(default resnet50=32,bert=16,mlp=64)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--wire", default="bfloat16",
                    help="also run membox with this wire dtype on the "
                    "largest node count (bfloat16, float16; none: skip)")
    # worker side
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.batch = int(a.batch)
        a.wire = "" if a.wire == "none" else a.wire
        return worker(a)

    import torch
    if not torch.cuda.is_available():
        print("membox bench gpu: no CUDA device (torch %s, CUDA %s): nothing "
              "to measure" % (torch.__version__, torch.version.cuda),
              file=sys.stderr)
        return 77
    a.iters = a.iters or (10 if a.quick else 30)
    a.warmup = a.warmup or (3 if a.quick else 5)
    batch = {"resnet50": 32, "bert": 16, "mlp": 64}
    for kv in filter(None, a.batch.split(",")):
        k, _, v = kv.partition("=")
        batch[k] = int(v)
    a.batch = batch
    nodes = [int(n) for n in (a.nodes or ("1" if a.quick else "1,2")).split(",")]
    models = a.models.split(",")
    gpu = torch.cuda.get_device_name(0)
    print(f"membox bench gpu: {gpu}, torch {torch.__version__}, "
          f"{a.workers} workers sharing it, {a.iters} iterations "
          f"(+{a.warmup} warm-up)", file=sys.stderr)
    records, rows = [], []
    tmp = tempfile.mkdtemp(prefix="membox-gpu-bench-")

    def rec(variant, model, r, metric, value, unit):
        records.append({"bench": "gpu", "variant": variant,
                        "size_bytes": r["param_bytes"], "workers": a.workers,
                        "metric": metric, "value": value, "unit": unit,
                        "case": model})

    for model in models:
        cases = [("compute", 0, ""), ("gloo", 0, "")] + \
            [("membox", n, "") for n in nodes]
        if a.wire not in ("", "none"):
            # Each wire dtype against Gloo with the same one.
            cases.append(("gloo", 0, a.wire))
            cases.append(("membox", max(nodes), a.wire))
        res = {}
        for scheme, n, wire in cases:
            variant = f"membox-{n}" if scheme == "membox" else scheme
            if wire:
                variant += "-" + {"bfloat16": "bf16",
                                  "float16": "fp16"}.get(wire, wire)
            print(f"  {model} {variant} ...", file=sys.stderr, flush=True)
            res[variant] = run_case(a, model, scheme, n, tmp, wire)
        floor = res["compute"]["iter_s"]
        for variant, r in res.items():
            rec(variant, model, r, "iter_ms", r["iter_s"] * 1e3, "ms")
            rec(variant, model, r, "blocked_ms",
                max(0.0, r["iter_s"] - floor) * 1e3, "ms")
            rec(variant, model, r, "final_loss", r["losses"][-1], "loss")
            for k in ("train_d2h_gbps", "train_h2d_gbps", "staging_d2h_gbps",
                      "staging_h2d_gbps", "pinned_d2h_gbps",
                      "pinned_h2d_gbps"):
                if k in r:
                    rec(variant, model, r, k.replace("_gbps", ""), r[k],
                        "GB/s")
            rows.append((model, variant, r))
    # Each variant against Gloo with the same wire dtype: "membox-2-bf16"
    # against "gloo-bf16", the rest against fp32 Gloo.
    def gloo_for(model, variant):
        suffix = variant.rsplit("-", 1)[1] if variant.endswith(
            ("-bf16", "-fp16")) else ""
        want = "gloo-" + suffix if suffix else "gloo"
        return next(r for mm, v, r in rows if mm == model and v == want)
    floor = {m: next(r for mm, v, r in rows if mm == m and v == "compute")
             for m in models}
    print("(vs gloo: against Gloo with the same wire dtype)")
    print(f"\n{'model':9} {'scheme':9} {'MB':>6} {'iter ms':>8} "
          f"{'blocked':>8} {'vs gloo':>8} {'blk vs':>7} {'loss':>8} "
          f"{'D2H GB/s':>9} {'copy/pin':>8}")
    for model, variant, r in rows:
        blk = max(0.0, r["iter_s"] - floor[model]["iter_s"])
        g = gloo_for(model, variant)
        gblk = max(1e-9, g["iter_s"] - floor[model]["iter_s"])
        rate = r.get("train_d2h_gbps")
        ratio = (r["staging_d2h_gbps"] / r["pinned_d2h_gbps"]
                 if "staging_d2h_gbps" in r else None)
        print(f"{model:9} {variant:9} {r['param_bytes'] / 1e6:6.0f} "
              f"{r['iter_s'] * 1e3:8.1f} {blk * 1e3:8.1f} "
              f"{r['iter_s'] / g['iter_s']:7.2f}x "
              f"{blk / gblk:6.2f}x {r['losses'][-1]:8.4f} "
              + (f"{rate:9.1f}" if rate else f"{'':9}")
              + (f" {ratio:7.2f}x" if ratio else ""))
    for model, variant, r in rows:
        if "pinned_d2h_gbps" in r:
            print(f"{model} {variant}: staging buffer D2H "
                  f"{r['staging_d2h_gbps']:.1f} GB/s, H2D "
                  f"{r['staging_h2d_gbps']:.1f} GB/s; torch page-locked D2H "
                  f"{r['pinned_d2h_gbps']:.1f} GB/s, H2D "
                  f"{r['pinned_h2d_gbps']:.1f} GB/s; during training D2H "
                  f"{r['train_d2h_gbps']:.1f} GB/s, H2D "
                  f"{r['train_h2d_gbps']:.1f} GB/s")
    from membox.bench_report import write_records
    write_records(records, a.csv, a.json)
    if a.plot:
        plot(rows, models, a.plot, gpu, a.workers)
    return 0


def plot(rows, models, path, gpu, workers):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        sel = [(v, r) for m, v, r in rows if m == model]
        names = [v for v, _ in sel]
        ax.bar(names, [r["iter_s"] * 1e3 for _, r in sel],
               color=["#999999" if v == "compute" else
                      "#d62728" if v == "gloo" else "#1f77b4" for v in names])
        ax.tick_params(axis="x", labelrotation=25)
        ax.set_title(f"{model}: iteration time")
        ax.set_ylabel("ms (median)")
    fig.suptitle(f"membox bench gpu: {workers} DDP workers on one {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
