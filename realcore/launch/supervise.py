"""Watching a local run: who died, who hangs, what to restart.

- The master exits 0 (done) or 75 (preempted, a recover checkpoint holds the run): the run ends so.
- A rollout-side process (generation server, gserver manager, rollout worker) that dies or hangs
  is restarted in place while training goes on (unless recover_mode=disabled); the others find it
  again through name resolution. One that keeps dying right after it starts is a failure.
- A master or model worker that dies or hangs fails the run (the launcher may restart it whole).
- Hangs: every realcore process touches `OUTPUT_DIR/.heartbeat/NAME` from a thread once per
  `system.heartbeat_interval_s`; a stopped or wedged process stops doing so, and after
  `system.heartbeat_timeout_s` it gets SIGUSR1 (its threads' stacks go to its log), then SIGKILL.
- SIGTERM (preemption) asks the master for a recover checkpoint at the end of its step (SIGUSR2)
  and waits `system.preempt_timeout_s` for it; SIGINT, or a second SIGTERM, stops at once (130).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass

from realcore.api.config import ExperimentConfig
from realcore.launch.local import Proc, describe_exit, dump_stacks_and_kill, stop_all
from realcore.transport import keys
from realcore.launch.process import PREEMPTED_EXIT
from realcore.rollout.server_stop import take_reason

ROLLOUT_SIDE = ("gen_server", "gserver_manager", "rollout_worker")
STABLE_S = 60.0  # a restarted process that lives this long is no longer "crash looping"


@dataclass
class Outcome:
    rc: int  # 0 done, 1 failed, 75 preempted, 130 interrupted
    why: str = ""  # what failed: "model_worker/1 died (killed by SIGKILL)"
    log_path: str | None = None


def heartbeat_path(output_dir: str, name: str) -> str:
    return os.path.join(output_dir, ".heartbeat", name.replace("/", "-"))


def record(output_dir: str, attempt: int, who: str, why: str, action: str) -> None:
    """One line per failure in OUTPUT_DIR/restarts.jsonl: what happened and what was done."""
    with open(os.path.join(output_dir, "restarts.jsonl"), "a") as f:
        f.write(json.dumps({"time": time.time(), "attempt": attempt, "who": who, "why": why, "action": action}) + "\n")


def begin_attempt(cfg: ExperimentConfig, resolver) -> None:
    """A whole-run start: no address, heartbeat or manager journal of an earlier attempt may be used."""
    resolver.clear(keys.scope(cfg))
    for folder in (".heartbeat", ".manager"):
        shutil.rmtree(os.path.join(cfg.output_dir, folder), ignore_errors=True)
    os.makedirs(os.path.join(cfg.output_dir, ".heartbeat"))


def last_beat(output_dir: str, name: str) -> float | None:
    """The wall time of `name`'s last heartbeat, or None before its first."""
    try:
        return os.stat(heartbeat_path(output_dir, name)).st_mtime
    except FileNotFoundError:
        return None


def hung(cfg: ExperimentConfig, name: str, started: float, now: float, margin: float = 1.0,
         beat: float | None = None) -> str | None:
    """Why realcore process `name` (started at monotonic time `started`) counts as hung (silent for
    margin x the heartbeat deadline), or None. Shared by the Supervisor and the cluster task runner.
    `beat`: its last heartbeat as seen earlier (default: now)."""
    sys_cfg = cfg.system
    deadline = margin * sys_cfg.heartbeat_timeout_s
    beat = last_beat(cfg.output_dir, name) if beat is None else beat
    if beat is None:  # still starting (imports): the startup deadline applies
        if now - started > sys_cfg.startup_timeout_s:
            return f"hung (no heartbeat within {sys_cfg.startup_timeout_s:g} s of its start)"
        return None
    silent = time.time() - beat
    if silent > deadline and now - started > deadline:
        return f"hung (no heartbeat for {silent:.0f} s; its stacks are in its log)"
    return None


def count_quick_death(counts: dict[str, int], name: str, started: float) -> int:
    """Deaths of `name` in a row, each within STABLE_S of its start (a crash loop); a life longer
    than that resets the count."""
    quick = time.monotonic() - started < STABLE_S
    counts[name] = counts.get(name, 0) + 1 if quick else 0
    return counts[name]


def write_pids(output_dir: str, procs: list[Proc]) -> None:
    tmp = os.path.join(output_dir, "pids.json.tmp")
    with open(tmp, "w") as f:
        json.dump({p.name: p.popen.pid for p in procs}, f)
    os.replace(tmp, os.path.join(output_dir, "pids.json"))


class Supervisor:
    def __init__(self, cfg: ExperimentConfig, procs: list[Proc], attempt: int, *, watch_heartbeats: set[str]):
        self.cfg, self.procs, self.attempt = cfg, procs, attempt
        self.watch_heartbeats = watch_heartbeats  # names of the processes that write heartbeats
        self.quick_deaths: dict[str, int] = {}
        self.signals: list[int] = []
        self.preempt_deadline: float | None = None

    def _hung(self, p: Proc, now: float, margin: float = 1.0) -> str | None:
        """Why `p` counts as hung (silent for margin x the heartbeat deadline), or None."""
        if p.name not in self.watch_heartbeats:
            return None
        return hung(self.cfg, p.name, p.started, now, margin)

    def _on_signal(self, signum, frame) -> None:
        self.signals.append(signum)

    def run(self) -> Outcome:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                outcome = self._poll()
                if outcome is not None:
                    return outcome
                time.sleep(0.2)
        finally:
            stop_all(self.procs, self.cfg.system.shutdown_timeout_s)
            for s, h in old.items():
                signal.signal(s, h)

    def _poll(self) -> Outcome | None:
        if self.signals:
            first = self.signals[0]
            if first == signal.SIGINT or len(self.signals) > 1:
                print(f"realcore: {signal.Signals(self.signals[-1]).name}: stopping all workers", file=sys.stderr)
                return Outcome(130)
            if self.preempt_deadline is None:
                self.preempt_deadline = time.monotonic() + self.cfg.system.preempt_timeout_s
                print(f"realcore: SIGTERM: the master writes a recover checkpoint after its current step "
                      f"(deadline {self.cfg.system.preempt_timeout_s:g} s)", file=sys.stderr, flush=True)
                self.procs[0].popen.send_signal(signal.SIGUSR2)
            elif time.monotonic() > self.preempt_deadline:
                print(f"realcore: no recover checkpoint within {self.cfg.system.preempt_timeout_s:g} s; stopping "
                      "(the last recover checkpoint holds the run)", file=sys.stderr)
                return Outcome(PREEMPTED_EXIT)
        now = time.monotonic()
        for p in self.procs:
            rc = p.popen.poll()
            # A worker that exits 0 left because the master told it to (EXIT at the end); nobody
            # tells a generation server to exit (vLLM exits 0 when its engine dies).
            if rc == 0 and p.name.split("/")[0] not in ("master", "gen_server"):
                continue
            why = f"died ({describe_exit(rc)})" if rc is not None else self._hung(p, now)
            if why is not None and rc is not None and p.name.startswith("gen_server/"):
                why = take_reason(self.cfg.output_dir, p.name) or why  # stopped by the manager: its reason
            if why is None:
                continue
            if p.name == "master" and rc in (0, PREEMPTED_EXIT):
                return Outcome(rc)
            if rc is not None and p.name.split("/")[0] in ("master", "model_worker"):
                # A peer that lost a hung worker (its own heartbeat deadline) dies about when the
                # hung one is found: blame the hung one.
                p = next((q for q in self.procs if q.popen.poll() is None and self._hung(q, now, margin=0.5)), p)
                why = self._hung(p, now, margin=0.5) or why
                if rc > 0 and p.popen.poll() == rc:  # a peer that lost a killed worker exits with an error after it
                    killed = next((q for q in self.procs if q.name.split("/")[0] in ("master", "model_worker")
                                   and (q.popen.poll() or 0) < 0), None)
                    if killed is not None:
                        p, why = killed, f"died ({describe_exit(killed.popen.poll())})"
            if p.popen.poll() is None:
                dump_stacks_and_kill(p)
            kind = p.name.split("/")[0]
            if kind in ROLLOUT_SIDE and self.cfg.recover_mode != "disabled" and p.start is not None:
                if self._restart_in_place(p, why):
                    continue
            return Outcome(1, f"{p.name} {why}", p.log_path)
        return None

    def _restart_in_place(self, p: Proc, why: str) -> bool:
        if count_quick_death(self.quick_deaths, p.name, p.started) > self.cfg.recover_retries:
            print(f"realcore: {p.name} died {self.quick_deaths[p.name]} times within {STABLE_S:g} s of starting; "
                  "giving up on it", file=sys.stderr)
            return False
        print(f"realcore: {p.name} {why}; restarting it (training goes on)", file=sys.stderr, flush=True)
        record(self.cfg.output_dir, self.attempt, p.name, why, "restart in place")
        try:
            os.remove(heartbeat_path(self.cfg.output_dir, p.name))
        except FileNotFoundError:
            pass
        p.restart()
        write_pids(self.cfg.output_dir, self.procs)
        return True
