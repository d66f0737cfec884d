"""Chaos benchmark: SIGKILL every kind of process of an asynchronous run, check that nothing was
lost or trained twice.

    python bench/chaos.py --trials 20 [--steps 24] [--seed 0] [--keep DIR]

Each trial launches `async-ppo-math model=tiny dataset=tiny-arith` (2 generation servers, the
manager, 2 rollout workers, 2 model workers, the master; `recover_mode=auto`, a recover
checkpoint every 2 steps) and, once the run has made progress, kills one process of each type in
turn (generation server, rollout worker, gserver manager, model worker, master) with SIGKILL, a
random one of its type at a random moment: the i-th once the run trained 2 + 3i steps (and
more than when the previous kill hit). Then it checks, from the run's ledger and its final recover checkpoint
(realcore.trainer.ledger.audit): exit code 0; no sequence trained twice; every step trained
`batch_size` groups; staleness within `max_head_offpolicyness`; no accepted rollout lost; and
that the trainer (master and model workers) kept its process ids through every rollout-side kill.
A run without faults gives the wall-time baseline. Prints one table (and one row per trial).

Everything is real (processes, sockets, signals, the built-in servers); nothing is simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
KINDS = ("gen_server", "rollout_worker", "gserver_manager", "model_worker", "master")
ROLLOUT_SIDE = ("gen_server", "rollout_worker", "gserver_manager")
BLAME_TIMEOUT_S = 120.0  # a kill the launcher has not recorded by then went unseen
BATCH, ETA = 4, 1


def launch_cmd(out: str, steps: int, cache: str, trial: str) -> list[str]:
    return [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "eval.freq_steps=null", "model=tiny", "dataset=tiny-arith",
            "allocation_mode=local.d2p1t1+d2p1t1", "rollout.n_workers=2", f"trainer.total_steps={steps}",
            f"trainer.batch_size={BATCH}", "generation.n_samples=2", "generation.max_new_tokens=16",
            "actor.optimizer.lr=1e-3", f"rollout.max_head_offpolicyness={ETA}", "recover_mode=auto",
            "recover_retries=5", "recover_delay_s=1", "trainer.recover_freq_steps=2", f"output_dir={out}",
            f"model.cache_dir={cache}", f"system.name_resolve.root={out}/nr", f"trial_name={trial}"]


def rows(out: str) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def last_step_s(out: str) -> float:
    """How long the run's last step took (a step of the tiny model takes 0.05-1 s by machine)."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return json.loads(f.readlines()[-1])["time/step_s"]
    except (FileNotFoundError, IndexError, ValueError, KeyError):
        return 1.0


def pids(out: str) -> dict[str, int]:
    try:
        with open(os.path.join(out, "pids.json")) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return {}


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited child not yet reaped still takes signals)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def restart_records(out: str) -> list[dict]:
    try:
        with open(os.path.join(out, "restarts.jsonl")) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


def blamed(out: str, since: int, name: str) -> dict | None:
    """After a kill of `name`: {} once restarts.jsonl (from record `since` on) names it; the record
    of a whole-run restart for another process if that came first (the kill then hit a process
    the launcher was already stopping, which nobody records); None while neither."""
    for r in restart_records(out)[since:]:
        if r["who"] == name:
            return {}
        if r["action"] != "restart in place":
            return r
    return None


def wait_for(cond, proc, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if cond():
            return True
        time.sleep(0.05)
    return False


def trial(out: str, steps: int, cache: str, rng: random.Random, kinds=KINDS, timeout_s: float = 900) -> dict:
    """Run one trial killing one process of each of `kinds` in turn; returns what happened."""
    from realcore.trainer.ledger import audit

    t0 = time.monotonic()
    log = open(out + ".log", "w")
    proc = subprocess.Popen(launch_cmd(out, steps, cache, os.path.basename(out)), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    kills, trainer_kept, at, missed = [], True, 0, None
    try:
        for i, kind in enumerate(kinds):
            # The i-th kill once the run trained 2 + 3i steps, and more than when the last kill hit
            # (a whole-run restart rewinds to its checkpoint first): every kill finds a live run.
            if not wait_for(lambda: rows(out) >= max(2 + 3 * i, at + 1), proc, timeout_s):
                missed = f"{kind}: the run ended (exit {proc.poll()}) or stalled before step {max(2 + 3 * i, at + 1)}"
                break
            time.sleep(rng.uniform(0, min(1.0, 2 * last_step_s(out))))  # a random moment within the next step or two
            now = pids(out)
            name = rng.choice(sorted(n for n in now if n.split("/")[0] == kind))
            trainer = {n: p for n, p in now.items() if n.split("/")[0] in ("master", "model_worker")}
            if not running(now[name]):
                missed = f"{kind}: {name} was no longer running at step {rows(out)}"
                break
            seen = len(restart_records(out))
            os.kill(now[name], signal.SIGKILL)
            kills.append(name)
            at = rows(out)
            # pids.json and metrics.jsonl describe an attempt until the next one starts: a kill that
            # lands while the run is already restarting for another reason hits a dying process.
            wait_for(lambda: blamed(out, seen, name) is not None, proc, min(timeout_s, BLAME_TIMEOUT_S))
            other = blamed(out, seen, name)
            if other is None:
                missed = f"{kind}: {name} was killed, and restarts.jsonl did not name it within {BLAME_TIMEOUT_S:g} s"
                break
            if other:
                missed = (f"{kind}: {name} was killed while the run restarted for {other['who']} "
                          f"({other['action']}: {other['why']})")
                break
            if kind in ROLLOUT_SIDE:  # training goes on: same trainer processes after more progress
                wait_for(lambda: rows(out) > at, proc, timeout_s)
                after = pids(out)
                trainer_kept &= all(after.get(n) == p for n, p in trainer.items())
            else:  # the whole run restarts: the next kill is for the new attempt's processes (the old
                # master may still log a step after the kill, and pids.json names it until then)
                wait_for(lambda: (m := pids(out).get("master")) not in (None, trainer.get("master")) and running(m),
                         proc, timeout_s)
        proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    wall = time.monotonic() - t0
    restarts = {}
    if os.path.exists(os.path.join(out, "restarts.jsonl")):
        for line in open(os.path.join(out, "restarts.jsonl")):
            r = json.loads(line)
            key = f"{r['who'].split('/')[0]}: {r['action']}"
            restarts[key] = restarts.get(key, 0) + 1
    a = audit(out, batch_size=BATCH, max_head_offpolicyness=ETA) if os.path.exists(os.path.join(out, "ledger.jsonl")) else None
    return {"rc": proc.returncode, "wall": wall, "kills": kills, "missed": missed, "restarts": restarts, "trainer_kept": trainer_kept,
            "audit": a}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20, help="training steps of each run (at least 16: the last kill comes after step 14)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="keep the runs' output folders here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = args.keep or tempfile.mkdtemp(prefix="rc-chaos-")
    os.makedirs(root, exist_ok=True)
    cache = os.path.join(root, "cache")
    try:
        base = trial(os.path.join(root, "baseline"), args.steps, cache, rng, kinds=())
        assert base["rc"] == 0, f"the run without faults failed: see {root}/baseline.log"
        results = []
        for i in range(args.trials):
            r = trial(os.path.join(root, f"trial{i}"), args.steps, cache, rng)
            a = r["audit"]
            print(f"trial {i}: exit {r['rc']}, {r['wall']:.0f} s, killed {', '.join(r['kills'])}; restarts {r['restarts']}; "
                  f"duplicated {a.duplicated if a else '?'}, lost {a.lost if a else '?'}, short steps {a.short_steps if a else '?'}, "
                  f"over-stale {a.over_stale if a else '?'}, trainer kept through rollout-side kills: {r['trainer_kept']}",
                  flush=True)
            results.append(r)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    ok = [r for r in results if r["rc"] == 0]
    restarts: dict[str, int] = {}
    for r in results:
        for k, v in r["restarts"].items():
            restarts[k] = restarts.get(k, 0) + v
    audits = [r["audit"] for r in results if r["audit"] is not None]
    walls = [r["wall"] for r in ok]
    print(f"\nchaos benchmark: async-ppo-math model=tiny, {args.steps} steps, batch {BATCH} x 2, eta {ETA}, "
          f"recover checkpoint every 2 steps; 5 SIGKILLs per trial (one per process type); this machine\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| trials | {len(results)} |")
    print(f"| finished (exit 0) | {len(ok)} |")
    for k in sorted(restarts):
        print(f"| restarts, {k} | {restarts[k]} |")
    print(f"| duplicated samples | {sum(a.duplicated for a in audits)} |")
    print(f"| lost samples | {sum(a.lost or 0 for a in audits)} |")
    print(f"| steps without batch_size groups | {sum(len(a.short_steps) for a in audits)} |")
    print(f"| samples over the staleness bound | {sum(a.over_stale for a in audits)} |")
    print(f"| trainer restarted by a rollout-side kill | {sum(not r['trainer_kept'] for r in results)} |")
    if walls:
        print(f"| wall time, run without faults | {base['wall']:.0f} s |")
        print(f"| wall time with 5 kills (median) | {statistics.median(walls):.0f} s "
              f"(+{statistics.median(walls) / base['wall'] - 1:.0%}) |")


if __name__ == "__main__":
    main()
