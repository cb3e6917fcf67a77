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
