#!/usr/bin/env python3
"""A memory node dies on one host and its replacement starts on another:
node failover across hosts, on the emulated cluster (`membox cluster`,
network namespaces; needs root).

Topology: 2 worker hosts, 3 memory hosts (m0, m1, m2, one parameter proxy
each, in one ring, `--ps-replicate`), every link shaped to --rate. The job
is the explicit parameter-server example (examples/train_ps.py: digits MLP,
SGD with momentum on the nodes) started through `membox cluster run`
(mpirun, `membox launch --attach`), as an operator runs it on real hosts.

Undisturbed run first, on a fresh cluster. Then, on another fresh cluster,
the same job; after epoch --kill-after-epoch, the node on m1 gets SIGKILL
and the operator's replacement, `membox serve --join --ps-rank 1` with the
dead node's slot in `--ps-peers` pointing at a new address on host m2, is
started at once. The workers' parameter clients find it there (`kWhere`,
asked of the survivors) and replay their state to it; the job must end by
itself with the undisturbed run's final loss and accuracy, to the last
digit (no round lost or repeated).

With --standby the topology has a standby host s0 (`standby = 1`:
`membox cluster up` starts `membox serve --standby` there) and nobody
starts anything after the kill: the standby claims m1's place and joins
at its own address.

Reported: kill -> the replacement serving ("joined" in its log, with what
it copied), kill -> each worker's "is back after" line, per-epoch
iteration times of both runs, final loss and accuracy.

    sudo scripts/cluster_failover.py [--rate 400mbit] [--epochs 40]
        [--kill-after-epoch 8] [--python out/venv/bin/python]
        [--json F] [--csv F] [--plot F.png]

With --state SIZE (e.g. 1GiB) the job is `membox bench failover`'s instead
(--job params, the default: one tensor with SGD momentum holding SIZE of
state on ring keys; --job striped: the same, striped; --job sums: a
striped tensor of SIZE without an optimizer; PushPull rounds; the
kill after round 4, the replacement on m2 as above). Reported: the pause
(the longest round after the kill minus the median round before it),
kill -> next round, kill -> the replacement's "joined: copied" (every
shard on two nodes again).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The build tree's package (with its extension), as `membox` itself sets it.
sys.path.insert(0, os.path.join(HERE, "build", "release", "python"))

from membox import cluster  # noqa: E402

NAME, SUBNET = "fo", "10.86.0"
NEW_PS, NEW_MEM, NEW_EMB = 7410, 7400, 7420


def topology(a, tmp):
    path = os.path.join(tmp, "failover.toml")
    with open(path, "w") as f:
        f.write(f'name = "{NAME}"\nsubnet = "{SUBNET}"\nworkers = 2\n'
                f'memory = 3\nrate = "{a.rate}"\nps_replicate = true\n'
                f'standby = {1 if a.standby else 0}\n'
                'pool = "256MiB"\nemb_budget = "64MiB"\n')
    return cluster.load_topology(path)


class StandbyProcess:
    """poll() of a process `membox cluster up` started (not our child)."""

    def __init__(self, pid):
        self.pid = pid

    def poll(self):
        try:
            os.kill(self.pid, 0)
            return None
        except ProcessLookupError:
            return 1


def start_replacement(a, topo, state, log):
    """The operator's replacement of m1, after the kill: on host m2 at a new
    address, `membox serve --join --ps-rank 1` naming that address in
    --ps-peers."""
    mem = cluster.memory_hosts(topo)
    host2 = mem[2]
    peers = [f"{h['ip']}:{cluster.PS_PORT}" for h in mem]
    peers[1] = f"{host2['ip']}:{NEW_PS}"
    place = ["--ps-rank", "1", "--join"]
    d = os.path.join(topo["state"], "m1-replacement")
    os.makedirs(d, exist_ok=True)
    argv = cluster.host_argv(topo, host2) + [
        a.membox, "--log-level", "info", "serve",
        "--listen", f"{host2['ip']}:{NEW_MEM}",
        "--pool-size", topo["pool"],
        "--secret-file", cluster.secret_file(topo),
        "--ps-listen", f"{host2['ip']}:{NEW_PS}",
        "--ps-peers", ",".join(peers), "--ps-replicate"] + place + [
        "--emb-listen", f"{host2['ip']}:{NEW_EMB}",
        "--emb-dir", os.path.join(d, "embedding"),
        "--emb-budget", topo["emb_budget"]]
    with open(log, "w") as logf:
        r = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                             start_new_session=True)
    state["nodes"].append({"host": "m2", "pid": r.pid, "log": log})
    with open(os.path.join(topo["state"], "state.json"), "w") as f:
        json.dump(state, f, indent=1)  # so `down` stops it too
    return r


def job(a, topo, out, kill_after, worker=None, flag=None):
    """Runs the job on a fresh cluster; with kill_after, kills m1's node
    after that epoch and starts its replacement on m2. Returns a dict.
    With `worker` (a command), that runs instead of the example: it prints
    "ROUND i t" per round, the kill comes after round kill_after, and
    `flag` is created once the replacement has copied everything."""
    cluster.down(topo, quiet=True)
    cluster.up(topo, log=lambda s: None)
    state = cluster._read_state(NAME)
    res = {"epochs": [], "kill_s": None, "joined_s": None, "back_s": [],
           "join_line": "", "rounds": {}}
    repl_log = os.path.join(topo["state"], "replacement.log")
    # With --standby, host s0's standby node (`standby = 1` in the
    # topology: `membox serve --standby`, started by `membox cluster up`)
    # watches from the start and takes m1's place by itself; else the
    # operator starts a replacement on m2 after the kill.
    r = None
    if a.standby:
        repl_log = [n for n in state["nodes"] if n["host"] == "s0"][0]["log"]
        r = StandbyProcess([n for n in state["nodes"]
                            if n["host"] == "s0"][0]["pid"])
    try:
        argv = cluster.mpirun_argv(
            topo, worker or [a.python, os.path.join(HERE, "examples",
                                                    "train_ps.py"),
                             "--epochs", str(a.epochs), "--out", out])
        env = dict(os.environ)
        env["MEMBOX_FAILOVER_S"] = "60"
        p = subprocess.Popen(argv, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1,
                             start_new_session=True, env=env)
        killed = threading.Event()
        t_kill = [None]
        lines = []

        def pump():
            for line in p.stdout:
                lines.append(line)
                now = time.time()
                if line.startswith("{") and '"epoch"' in line:
                    rec = json.loads(line)
                    rec["t"] = now
                    res["epochs"].append(rec)
                    if kill_after and rec["epoch"] == kill_after:
                        killed.set()
                if line.startswith("ROUND "):
                    i = int(line.split()[1])
                    res["rounds"].setdefault(i, float(line.split()[2]))
                    if kill_after and i == kill_after:
                        killed.set()
                if "is back after" in line and t_kill[0]:
                    res["back_s"].append(round(now - t_kill[0], 3))

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        if kill_after:
            if not killed.wait(900):
                raise RuntimeError("the job did not reach the kill epoch:\n"
                                   + "".join(lines[-40:]))
            victim = [n for n in state["nodes"] if n["host"] == "m1"][0]
            t_kill[0] = time.time()
            os.kill(victim["pid"], 9)
            res["kill_s"] = t_kill[0]
            if r is None:
                r = start_replacement(a, topo, state, repl_log)
            while time.time() - t_kill[0] < 600:
                with open(repl_log) as f:
                    text = f.read()
                if "taking its place" in text and "claim_line" not in res:
                    res["claim_line"] = [x for x in text.splitlines()
                                         if "taking its place" in x][0]
                    res["claim_s"] = round(time.time() - t_kill[0], 3)
                if "joined: copied" in text:
                    res["joined_s"] = round(time.time() - t_kill[0], 3)
                    res["join_line"] = [x for x in text.splitlines()
                                        if "joined: copied" in x][0]
                    if flag:
                        open(flag, "w").close()
                    break
                if r.poll() is not None:
                    raise RuntimeError("the replacement exited:\n" + text)
                time.sleep(0.02)
        res["exit"] = p.wait()
        t.join(5)
        res["log_tail"] = "".join(lines[-40:])
    finally:
        cluster.down(topo, quiet=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--membox", default=os.path.join(HERE, "build", "release",
                                                     "tools", "membox"))
    ap.add_argument("--python", default=os.path.join(HERE, "out", "venv", "bin",
                                                     "python"))
    ap.add_argument("--rate", default="400mbit")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--kill-after-epoch", type=int, default=8)
    ap.add_argument("--standby", action="store_true",
                    help="a standby host (s0, `membox serve --standby`, "
                         "from the topology's `standby = 1`) takes the dead "
                         "node's place by itself")
    ap.add_argument("--json", default="")
    ap.add_argument("--csv", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--state", default="",
                    help="instead of the example: one tensor with SGD "
                         "momentum holding this much state (e.g. 1GiB), "
                         "PushPull rounds, the kill after round 4; reports "
                         "the pause and the time to full redundancy")
    ap.add_argument("--job", choices=("params", "striped", "sums"),
                    default="params",
                    help="with --state: `membox bench failover`'s job. "
                         "params: ring keys (every node holds the whole "
                         "state, the replacement copies all of it); "
                         "striped: the tensor striped, as a profiled job's "
                         "keys are on equal links (the replacement copies "
                         "the third it owns); sums: a striped tensor "
                         "without an optimizer, the workers holding their "
                         "pushes (the replacement copies nothing and "
                         "redoes the last round)")
    a = ap.parse_args()
    cluster.require_root()
    os.environ["MEMBOX_BIN"] = os.path.abspath(a.membox)
    tmp = tempfile.mkdtemp(prefix="membox-fo-")
    os.chmod(tmp, 0o755)
    topo = topology(a, tmp)
    if a.state:
        return state_run(a, topo, tmp)
    plain = job(a, topo, os.path.join(tmp, "plain.jsonl"), 0)
    print("undisturbed:", json.dumps(plain["epochs"][-1]), flush=True)
    hit = job(a, topo, os.path.join(tmp, "killed.jsonl"), a.kill_after_epoch)
    print("with the kill:", json.dumps(hit["epochs"][-1]), flush=True)
    if hit["exit"] != 0 or hit["epochs"][-1]["epoch"] != a.epochs:
        sys.exit(f"FAIL: the job with the kill ended after epoch "
                 f"{hit['epochs'][-1]['epoch']} of {a.epochs} (exit "
                 f"{hit['exit']}); its last lines:\n{hit['log_tail']}")
    print(hit["join_line"], flush=True)
    last, base = hit["epochs"][-1], plain["epochs"][-1]
    same = (last["loss"], last["accuracy"]) == (base["loss"], base["accuracy"])
    summary = {
        "rate": a.rate, "epochs": a.epochs,
        "kill_after_epoch": a.kill_after_epoch,
        "replacement": "standby" if a.standby else "operator's --join",
        "replacement_joined_s": hit["joined_s"],
        "standby_claimed_s": hit.get("claim_s"),
        "workers_back_s": hit["back_s"],
        "recovery_s": max(hit["back_s"]) if hit["back_s"] else None,
        "join_line": hit["join_line"],
        "claim_line": hit.get("claim_line", ""),
        "final_loss": last["loss"], "final_accuracy": last["accuracy"],
        "undisturbed_final_loss": base["loss"],
        "undisturbed_final_accuracy": base["accuracy"],
        "same_result": same, "exit": hit["exit"],
        "epochs_plain": plain["epochs"], "epochs_killed": hit["epochs"],
    }
    kill_epoch = a.kill_after_epoch + 1  # the epoch the kill fell into
    for name, run in (("undisturbed", plain), ("killed", hit)):
        its = [e["iteration_ms"] for e in run["epochs"]
               if e["epoch"] != kill_epoch]
        its.sort()
        summary[f"{name}_median_iteration_ms"] = its[len(its) // 2]
        summary[f"{name}_kill_epoch_iteration_ms"] = [
            e["iteration_ms"] for e in run["epochs"]
            if e["epoch"] == kill_epoch][0]
    print(json.dumps({k: v for k, v in summary.items()
                      if not k.startswith("epochs_")}, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("epoch,undisturbed_iteration_ms,killed_iteration_ms,"
                    "undisturbed_loss,killed_loss\n")
            for e0, e1 in zip(plain["epochs"], hit["epochs"]):
                f.write(f"{e0['epoch']},{e0['iteration_ms']},"
                        f"{e1['iteration_ms']},{e0['loss']},{e1['loss']}\n")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for name, run, style in (("undisturbed", plain, "o-"),
                                 ("node m1 killed, replaced on m2", hit, "s-")):
            ax.plot([e["epoch"] for e in run["epochs"]],
                    [e["iteration_ms"] for e in run["epochs"]], style,
                    ms=3, label=name)
        ax.axvline(kill_epoch, color="grey", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xlabel("epoch (the kill falls into the marked one)")
        ax.set_ylabel("mean iteration (ms)")
        ax.set_title(f"Node failover across hosts: 2 workers, 3 memory "
                     f"hosts, {a.rate} links")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    if hit["exit"] != 0 or not same:
        sys.exit(f"FAIL: exit {hit['exit']}, final {last} vs undisturbed {base}"
                 f"\n{hit['log_tail']}")


def state_run(a, topo, tmp):
    """--state: the pause a node's death adds across hosts, against the
    state's size (membox bench failover's job, on the emulated cluster)."""
    from membox import failover_bench as fb
    size = fb._size(a.state)
    script = os.path.join(tmp, "failover_worker.py")
    with open(script, "w") as f:
        f.write(fb.WORKER)
    flag = os.path.join(tmp, "copied")
    # The worker's tensor: S/2 with its momentum (params, striped), or S of
    # sums without an optimizer (sums; the workers hold their pushes, as
    # they do by default across hosts).
    tensor = size if a.job == "sums" else size // 2
    hit = job(a, topo, None, 4, worker=[a.python, script, str(tensor), flag,
                                        a.job], flag=flag)
    rounds = [hit["rounds"][i] for i in sorted(hit["rounds"])]
    t_kill = hit["kill_s"]
    before = [b - x for x, b in zip(rounds[:4], rounds[1:5])]
    after = [r for r in rounds if r > t_kill]
    gaps = [b - x for x, b in zip(rounds[4:], rounds[5:])]
    base = sorted(before)[len(before) // 2]
    res = {"rate": a.rate, "job": a.job, "state_bytes": size, "round_s": base,
           "pause_s": max(gaps) - base if gaps else None,
           "kill_to_round_s": after[0] - t_kill if after else None,
           "redundancy_s": hit["joined_s"], "join_line": hit["join_line"],
           "workers_back_s": hit["back_s"], "rounds": len(rounds),
           "round_times_s": [round(b - x, 3) for x, b in zip(rounds, rounds[1:])],
           "replacement": "standby" if a.standby else "operator's --join on m2",
           "exit": hit["exit"]}
    print(json.dumps(res, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if hit["exit"] != 0:
        sys.exit(f"FAIL: exit {hit['exit']}\n{hit['log_tail']}")


if __name__ == "__main__":
    main()
