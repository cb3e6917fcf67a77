#!/usr/bin/env python3
"""How much of a step's link time is idle: samples the byte counters of
network interfaces (the emulated cluster's veths, seen from this machine's
side) every few milliseconds while a command runs, and reports, between
two lines of its output (the steady state), each direction's share of time
busy (above a tenth of the line rate) and idle, and what it moved.

    sudo scripts/link_idle.py --ifaces mbxw4m4w0,mbxw4m4m0 --rate-mbit 400 \\
        --from 'step 10' --to 'step 20' [--csv F] [--plot F.png] \\
        -- membox cluster run examples/cluster/4w4m.toml -- PY \\
           examples/transformer_lm.py --backend membox --d-model 512 \\
           --layers 4 --batch 1 --steps 20

On this machine's side of a veth, tx is what the host receives and rx what
it sends. Issue 42 asks for this figure: backup traffic between memory
nodes can only hide in link time the workers leave idle
(docs/design/ps.md, "Primary-backup").
"""
import argparse
import subprocess
import sys
import threading
import time


def _read(iface, what):
    with open(f"/sys/class/net/{iface}/statistics/{what}_bytes") as f:
        return int(f.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ifaces", required=True)
    ap.add_argument("--rate-mbit", type=float, default=400)
    ap.add_argument("--from", dest="start", required=True)
    ap.add_argument("--to", dest="end", required=True)
    ap.add_argument("--interval-ms", type=float, default=5)
    ap.add_argument("--csv", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    ifaces = a.ifaces.split(",")
    samples = []  # (t, {iface: (tx, rx)})
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic(),
                            {i: (_read(i, "tx"), _read(i, "rx"))
                             for i in ifaces}))
            time.sleep(a.interval_ms / 1e3)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    marks = {}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in p.stdout:
        sys.stdout.write(line)
        for name, pat in (("start", a.start), ("end", a.end)):
            if pat in line and name not in marks:
                marks[name] = time.monotonic()
    rc = p.wait()
    stop.set()
    th.join()
    if rc != 0 or len(marks) < 2:
        print(f"link_idle: the command failed (exit {rc}) or printed no "
              f"{a.start!r} / {a.end!r}", file=sys.stderr)
        return 1
    t0, t1 = marks["start"], marks["end"]
    window = [s for s in samples if t0 <= s[0] <= t1]
    line_rate = a.rate_mbit * 1e6 / 8  # bytes/s
    rows = []
    print(f"\nsteady state: {t1 - t0:.2f} s, {len(window)} samples "
          f"({a.interval_ms:g} ms); busy = above 10 % of "
          f"{a.rate_mbit:g} Mbit/s")
    print(f"{'link':22} {'busy':>6} {'idle':>6} {'MB':>8} {'MB/s busy':>10}")
    series = []
    for i in ifaces:
        for k, label in ((0, "into the host"), (1, "out of the host")):
            busy_t = idle_t = moved = 0.0
            for (ta, ca), (tb, cb) in zip(window, window[1:]):
                dt = tb - ta
                n = cb[i][k] - ca[i][k]
                moved += n
                rate = n / dt if dt > 0 else 0
                series.append((round(tb - t0, 4), i, label, rate))
                if rate > 0.1 * line_rate:
                    busy_t += dt
                else:
                    idle_t += dt
            tot = busy_t + idle_t or 1
            name = f"{i} {label}"
            print(f"{name:22} {busy_t / tot:6.0%} {idle_t / tot:6.0%} "
                  f"{moved / 1e6:8.1f} "
                  f"{(moved / busy_t / 1e6 if busy_t else 0):10.1f}")
            rows.append({"iface": i, "direction": label,
                         "busy_frac": busy_t / tot, "idle_frac": idle_t / tot,
                         "mbytes": moved / 1e6, "seconds": tot})
    if a.csv:
        import csv
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(len(ifaces), 1, figsize=(9, 2.4 * len(ifaces)),
                                 sharex=True)
        axes = axes if len(ifaces) > 1 else [axes]
        for ax, i in zip(axes, ifaces):
            for label in ("into the host", "out of the host"):
                pts = [(t, r / 1e6) for t, j, lb, r in series
                       if j == i and lb == label]
                ax.plot([x for x, _ in pts], [y for _, y in pts], lw=0.8,
                        label=label)
            ax.axhline(line_rate / 1e6, color="grey", lw=0.5, ls="--")
            ax.set_ylabel(f"{i}\nMB/s")
            ax.legend(fontsize=7, loc="upper right")
        axes[-1].set_xlabel("seconds into the steady state")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
