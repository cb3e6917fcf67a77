"""Writing benchmark records (docs/design/benchmarks.md) from the Python
benchmarks: a JSON list and a CSV with the contract's columns."""
import csv
import json

FIELDS = ["bench", "variant", "size_bytes", "workers", "metric", "value",
          "unit", "case"]


def write_records(records, csv_path="", json_path=""):
    """Writes `records` (dicts with the contract's keys; extra keys go to
    the JSON only) to the paths given (an empty path: not written)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(records)


def add_contract_flags(ap):
    """The flags every benchmark takes (docs/design/benchmarks.md): --quick,
    --csv F, --json F, --plot F.png."""
    ap.add_argument("--quick", action="store_true",
                    help="a short run (smaller sizes, fewer repeats)")
    ap.add_argument("--csv", default="", help="write the records as CSV")
    ap.add_argument("--json", default="", help="write the records as JSON")
    ap.add_argument("--plot", default="", help="write a PNG plot")


def bench_parser(prog, description, workers=2, nodes=1):
    """The argument parser a `membox bench` starts from: the contract flags
    (add_contract_flags), --workers and --nodes with this bench's defaults,
    and the hidden flags its own worker runs take (--worker, --variant,
    --out)."""
    import argparse
    ap = argparse.ArgumentParser(
        prog=prog, description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_contract_flags(ap)
    ap.add_argument("--workers", type=int, default=workers)
    ap.add_argument("--nodes", type=int, default=nodes)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    return ap


def median_runs(results, key, scale=1.0, ndigits=None):
    """Per variant of `results` (variant -> its runs, dicts), the run whose
    `key` is the median, with "all": every run's key times `scale`, rounded
    to `ndigits`, in run order."""
    rows = {}
    for v, runs in results.items():
        mid = sorted(runs, key=lambda x: x[key])[len(runs) // 2]
        rows[v] = dict(mid, all=[round(x[key] * scale, ndigits)
                                 for x in runs])
    return rows


def run_launched(cmd, out, what, die):
    """Runs `cmd` (a `membox launch ... --out OUT` command line), which
    writes its result as JSON to `out`; returns that result. When the run
    fails or writes nothing: the output's tail on stderr, then
    die(f"{what} failed (exit N)")."""
    import os
    import subprocess
    import sys
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    if p.returncode != 0 or not os.path.exists(out):
        sys.stderr.write(p.stdout[-6000:])
        die(f"{what} failed (exit {p.returncode})")
    with open(out) as f:
        return json.load(f)


def free_port():
    """A port for a rendezvous the bench's torch workers bind later: the
    launcher's rule (membox.launch.free_port: below the kernel's ephemeral
    range, never handed out twice), not a port bound to 0, which an
    outgoing connection may take before the workers bind it."""
    from membox.launch import free_port as launcher_free_port
    return launcher_free_port()


def children_cpu():
    """User + system CPU seconds of this process's finished children."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_interleaved(variants, repeats, run):
    """{variant: [run(variant) per repeat]}: every variant once per round,
    `repeats` rounds, so drift on a shared machine hits every variant
    alike; progress goes to stderr."""
    import sys
    res = {v: [] for v in variants}
    n = len(variants) * repeats
    done = 0
    for _ in range(repeats):
        for v in variants:
            done += 1
            print(f"[{done}/{n}] {v}", file=sys.stderr, flush=True)
            res[v].append(run(v))
    return res
