#!/usr/bin/env python3
"""The reference for membox's recovery times: torchft's fault-tolerant DDP
(PyTorch's own answer to "keep training through failures", issue 15) on the
same job as scripts/chaos.py -- the digits MLP of examples/train_ps.py
(64-128-10, SGD lr 0.1 momentum 0.9, batch 32 per worker, 22 steps per
epoch) -- with 2 replica groups of one process each on the same two cores,
a torchft lighthouse, and Gloo. Every --interval seconds a random replica
is killed with SIGKILL and started again at once (what `membox launch
--max-restarts` does for membox); the restarted replica heals from its
peer (torchft's checkpoint transport) and rejoins the quorum.

Reported per kill, the way scripts/chaos.py reports membox's:
  * recovery: the kill to the restarted replica's first committed step
    with both replicas in the quorum (membox: the kill to the restarted
    workers' first step);
  * the survivor's stall: its longest gap between two steps after the
    kill (torchft lets the survivor go on alone once the quorum drops the
    dead replica; membox's synchronous job waits for the restart);
and the steps per second with and without kills. torchft's result after
kills differs from the undisturbed one by design (steps run with fewer
replicas); the final loss and accuracy of both runs are reported.

Needs torchft (PyPI: pip install torchft; it brings the torchft_lighthouse
command) in the interpreter given by --python (default: this one).

    scripts/torchft_chaos.py [--kills 8] [--interval 2.5] [--epochs 600]
                             [--json F] [--csv F] [--plot F.png]
"""
import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- worker

def worker(a):
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.nn as nn
    from sklearn.datasets import load_digits
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    replicas = a.replicas
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).flatten(1)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = np.random.RandomState(0).permutation(len(y))
    train, test = perm[:1440], perm[1440:]
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    # The replica group's own store (torchrun's job when it starts a group).
    store = torch.distributed.TCPStore(  # noqa: F841 (kept alive)
        "127.0.0.1", a.store_port, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout)),
        min_replica_size=1, load_state_dict=load_state_dict,
        state_dict=state_dict, replica_id=f"chaos_{replica}",
        timeout=timedelta(seconds=a.pg_timeout),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=30), rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=a.store_port)
    ddp = DistributedDataParallel(manager, model)
    loss_fn = nn.CrossEntropyLoss()
    steps = (len(train) // replicas) // a.batch
    total = a.epochs * steps
    joined = False
    last = time.time()
    losses = []
    while manager.current_step() < total:
        step = manager.current_step()
        epoch, i = divmod(step, steps)
        order = np.random.RandomState(epoch + 1).permutation(train)[
            replica::replicas]
        idx = torch.tensor(order[i * a.batch:(i + 1) * a.batch])
        manager.start_quorum()
        opt.zero_grad()
        loss = loss_fn(ddp(x[idx]), y[idx])
        loss.backward()
        if manager.should_commit():
            opt.step()
            losses.append(loss.item())
            now = time.time()
            if now - last > 0.3:
                print(f"GAP {now - last:.3f} AT {now:.3f}", flush=True)
            last = now
            if not joined and manager.num_participants() == replicas:
                joined = True
                print(f"JOINED {now:.3f} STEP {step}", flush=True)
            if step % 50 == 0:
                print(f"STEP {now:.3f} STEP {step}", flush=True)
            if (step + 1) % steps == 0 and replica == 0:
                with torch.no_grad():
                    acc = (model(x[test]).argmax(1) == y[test]).float().mean()
                rec = {"epoch": (step + 1) // steps,
                       "loss": float(np.mean(losses)),
                       "accuracy": float(acc)}
                losses = []
                with open(a.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    manager.shutdown(wait=False)
    print(f"DONE {time.time():.3f}", flush=True)
    os._exit(0)


# ---------------------------------------------------------------- driver

def run(a, out, kills):
    """One job; with kills > 0 a random replica is killed every interval
    and restarted. Returns wall time, steps, per-kill records, last record."""
    lport = free_port()
    env = dict(os.environ)
    env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{lport}"
    env["RUST_LOG"] = "warn"
    lighthouse = subprocess.Popen(
        [os.path.join(os.path.dirname(a.python), "torchft_lighthouse"),
         "--min_replicas", "1", "--quorum_tick_ms", "100",
         "--join_timeout_ms", str(a.join_timeout_ms),
         "--bind", f"127.0.0.1:{lport}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    ports = [free_port() for _ in range(a.replicas)]
    events = []  # (time, replica, kind, value)
    procs, pumps = {}, []
    lock = threading.Lock()

    def start(r):
        e = dict(env, REPLICA_GROUP_ID=str(r))
        p = subprocess.Popen(
            [a.python, os.path.abspath(__file__), "--worker", "--out", out,
             "--epochs", str(a.epochs), "--replicas", str(a.replicas),
             "--store-port", str(ports[r]), "--pg-timeout",
             str(a.pg_timeout)],
            env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1)

        def pump():
            for line in p.stdout:
                w = line.split()
                if w and w[0] in ("JOINED", "GAP", "DONE", "STEP"):
                    t = float(w[1]) if w[0] != "GAP" else float(w[3])
                    v = float(w[1]) if w[0] == "GAP" else \
                        int(w[3]) if w[0] in ("JOINED", "STEP") else None
                    with lock:
                        events.append((t, r, w[0], v, p.pid))
                elif a.verbose or "Error" in line or "Traceback" in line:
                    sys.stderr.write(f"[replica {r}] {line}")
        th = threading.Thread(target=pump, daemon=True)
        th.start()
        pumps.append(th)
        procs[r] = p

    t0 = time.time()
    for r in range(a.replicas):
        start(r)
    # A replica that exits by itself before the end (torchft raised) is
    # restarted like a killed one (torchelastic's job); counted as a crash.
    crashes = []
    killed = set()
    stop = threading.Event()

    def supervise():
        while not stop.is_set():
            for r, p in list(procs.items()):
                rc = p.poll()
                if rc is None or p.pid in killed:
                    continue
                with lock:
                    done = any(e[2] == "DONE" and e[4] == p.pid
                               for e in events)
                if done:
                    continue
                crashes.append({"replica": r, "t": time.time(), "exit": rc})
                print(f"replica {r} exited by itself ({rc}); restarting it",
                      flush=True)
                start(r)
            time.sleep(0.05)
    sup = threading.Thread(target=supervise, daemon=True)
    sup.start()
    rng = random.Random(a.seed)
    kills_done = []
    if kills:
        deadline = time.time() + 120
        while time.time() < deadline:  # both in the quorum
            with lock:
                if sum(1 for e in events if e[2] == "JOINED") >= a.replicas:
                    break
            time.sleep(0.05)
        for k in range(kills):
            time.sleep(a.interval)
            with lock:
                if any(e[2] == "DONE" for e in events):
                    break
            r = rng.randrange(a.replicas)
            t_kill = time.time()
            killed.add(procs[r].pid)
            os.kill(procs[r].pid, signal.SIGKILL)
            procs[r].wait()
            start(r)
            deadline = time.time() + 120
            rec = None
            joined_at = None
            while time.time() < deadline and rec is None:
                with lock:  # replica r's next process in the quorum
                    for e in events:
                        if e[2] == "JOINED" and e[1] == r and e[0] > t_kill:
                            rec, joined_at = e[0] - t_kill, e[3]
                time.sleep(0.02)
            with lock:  # the job's step when it was killed
                before = [e for e in events if e[2] == "STEP"
                          and e[0] <= t_kill]
                reached = max(before, key=lambda e: e[0])[3] if before else 0
            # Steps the job lost: it went on from an earlier step than it
            # had reached (every replica died: nobody held the state).
            kills_done.append({"replica": r, "t_kill": t_kill,
                               "recovery_s": rec, "step_reached": reached,
                               "rejoined_at_step": joined_at,
                               "steps_lost": max(0, reached - joined_at)
                               if joined_at is not None else None})
            print(f"kill {k + 1}: replica {r}, back in the quorum after "
                  f"{rec if rec is None else round(rec, 2)} s at step "
                  f"{joined_at} (the job had reached {reached})", flush=True)
    deadline = time.time() + a.epochs * 2 + 120
    while time.time() < deadline:
        with lock:
            done = {e[1] for e in events if e[2] == "DONE"}
        if len(done) == a.replicas:
            break
        time.sleep(0.05)
    wall = time.time() - t0
    stop.set()
    sup.join()
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait()
    lighthouse.terminate()
    lighthouse.wait()
    # The survivor's longest gap between steps within 10 s of each kill.
    for kd in kills_done:
        other = [e for e in events if e[2] == "GAP" and e[1] != kd["replica"]
                 and kd["t_kill"] <= e[0] <= kd["t_kill"] + 10]
        kd["survivor_stall_s"] = max([e[3] for e in other], default=0.0)
    recs = {}
    with open(out) as f:
        for x in f:
            if x.strip():
                rec = json.loads(x)
                recs[rec["epoch"]] = rec  # a re-run epoch: the last one
    return wall, kills_done, [recs[e] for e in sorted(recs)], crashes


def plot(res, path, interval):
    """Per kill: the time until the killed replica is back in the quorum,
    and the survivor's longest stall -- or, where the survivor crashed
    too, the steps the job lost."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kills = res["per_kill"]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    seen = set()

    def once(label):
        if label in seen:
            return None
        seen.add(label)
        return label
    for i, k in enumerate(kills):
        x = i + 1
        lost = k.get("steps_lost")
        if lost:
            ax.bar(x - 0.2, k["recovery_s"] or 0, width=0.4, color="#d62728",
                   label=once("back; the survivor had crashed too"))
            ax.text(x - 0.2, (k["recovery_s"] or 0) + 0.1,
                    f"{lost} steps\nlost", ha="center", fontsize=7)
        else:
            ax.bar(x - 0.2, k["recovery_s"] or 0, width=0.4, color="#ff7f0e",
                   label=once("back in the quorum"))
            ax.bar(x + 0.2, k["survivor_stall_s"], width=0.4,
                   color="#9467bd", label=once("survivor's longest stall"))
    ax.set_xlabel("kill (SIGKILL every %.1f s)" % interval)
    ax.set_ylabel("seconds")
    ax.set_ylim(0, 7.5)
    ax.set_title(f"torchft DDP, {res['replicas']} replica groups "
                 f"(Gloo, CPU)")
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="")
    ap.add_argument("--store-port", type=int, default=0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--interval", type=float, default=2.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pg-timeout", type=float, default=5.0,
                    help="Gloo and manager timeout, s (torchft's example: 5)")
    ap.add_argument("--join-timeout-ms", type=int, default=1000,
                    help="lighthouse: how long a quorum waits for joiners")
    ap.add_argument("--verbose", action="store_true",
                    help="print the replicas' output")
    ap.add_argument("--json", default="")
    ap.add_argument("--csv", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--replot", default="",
                    help="only draw --plot from this --json result")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.replot:
        with open(a.replot) as f:
            return plot(json.load(f), a.plot, a.interval)
    tmp = tempfile.mkdtemp(prefix="torchft-chaos-")
    plain_wall, _, plain, plain_crashes = run(
        a, os.path.join(tmp, "plain.jsonl"), 0)
    wall, kills, recs, crashes = run(a, os.path.join(tmp, "chaos.jsonl"),
                                     a.kills)
    steps = a.epochs * ((1440 // a.replicas) // a.batch)
    rec_t = [k["recovery_s"] for k in kills if k["recovery_s"] is not None]
    stall = [k["survivor_stall_s"] for k in kills]
    res = {
        "system": "torchft", "replicas": a.replicas, "epochs": a.epochs,
        "kills": len(kills), "recovered": len(rec_t),
        "recovery_median_s": statistics.median(rec_t) if rec_t else None,
        "recovery_max_s": max(rec_t) if rec_t else None,
        "survivor_stall_median_s": statistics.median(stall) if stall else None,
        "survivor_stall_max_s": max(stall) if stall else None,
        "per_kill": kills, "wall_s": wall, "undisturbed_wall_s": plain_wall,
        "steps_per_s": steps / wall, "undisturbed_steps_per_s":
            steps / plain_wall,
        "final_loss": recs[-1]["loss"] if recs else None,
        "undisturbed_final_loss": plain[-1]["loss"] if plain else None,
        "final_accuracy": recs[-1]["accuracy"] if recs else None,
        "undisturbed_final_accuracy": plain[-1]["accuracy"] if plain else None,
        "crashes": crashes, "undisturbed_crashes": plain_crashes,
        "kills_losing_steps": sum(1 for k in kills if k["steps_lost"]),
        "steps_lost": sum(k["steps_lost"] or 0 for k in kills),
        # Epochs whose last step a healing replica skipped have no record.
        "epoch_records": len(recs), "undisturbed_epoch_records": len(plain),
        "pg_timeout_s": a.pg_timeout, "join_timeout_ms": a.join_timeout_ms}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("kill,replica,recovery_s,survivor_stall_s\n")
            for i, k in enumerate(kills):
                r = "" if k["recovery_s"] is None else f"{k['recovery_s']:.3f}"
                f.write(f"{i + 1},{k['replica']},{r},"
                        f"{k['survivor_stall_s']:.3f}\n")
    if a.plot and kills:
        plot(res, a.plot, a.interval)
    if len(rec_t) != len(kills) or not recs or recs[-1]["epoch"] != a.epochs:
        sys.exit(f"FAIL: {len(rec_t)} of {len(kills)} kills recovered, "
                 f"last epoch record {recs[-1]['epoch'] if recs else None}")


if __name__ == "__main__":
    main()
