"""`OUTPUT_DIR/ledger.jsonl`: one line per trained sequence, so users (and tests) can see that no
sample was trained twice or lost, and that staleness stayed within its bound, across restarts.

A row: `step`, `sample_id` ("{shard}:{seq}/{j}": which prompt of which data shard, which of its n
samples; stable across restarts), `version_start` / `version_end` (the policy versions that
generated it) and `trained_version` (the version the update that used it started from).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from realcore.trainer import recover
from realcore.trainer.recover import truncate_jsonl


class Ledger:
    def __init__(self, output_dir: str, *, resume_step: int):
        """Continue after `resume_step` (0: a new run): rows of later steps are dropped first."""
        self.path = os.path.join(output_dir, "ledger.jsonl")
        # Rows after the checkpoint (all of them from step 0) are the failed attempt's; the launcher
        # refuses a fresh run into another run's records (run_lock.claim_output), so none are its.
        truncate_jsonl(self.path, resume_step)
        self._file = open(self.path, "a", buffering=1)

    def trained_prompts(self) -> set[str]:
        """The prompts (sample_id without "/j") already trained in this run."""
        out = set()
        with open(self.path) as f:
            for line in f:
                out.add(json.loads(line)["sample_id"].rsplit("/", 1)[0])
        return out

    def write(self, step: int, trained_version: int, groups: list[tuple[str, int, list[int], list[int]]]) -> None:
        """groups: (prompt uid, group size, version_start per sequence, version_end per sequence)."""
        lines = []
        for uid, n, starts, ends in groups:
            for j in range(n):
                lines.append(json.dumps({"step": step, "sample_id": f"{uid}/{j}", "version_start": starts[j],
                                         "version_end": ends[j], "trained_version": trained_version}) + "\n")
        self._file.write("".join(lines))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class Audit:
    """What a finished run's ledger and final recover checkpoint say (see `audit`)."""

    rows: int
    steps: int
    duplicated: int  # sequences trained more than once
    short_steps: list[int]  # steps that did not train `batch_size` groups
    over_stale: int  # sequences trained more than max_head_offpolicyness versions after they started
    lost: int | None  # async: rollouts accepted but neither taken by the master nor waiting (None: no checkpoint)


def audit(output_dir: str, *, batch_size: int, max_head_offpolicyness: int | None = None) -> Audit:
    """Check a run's ledger: no sequence twice, `batch_size` groups every step, staleness within
    the bound; and, from the last recover checkpoint (async), that every rollout the manager
    counted as accepted and the master has not taken yet (trained or dropped as too stale) is
    waiting in a stream."""
    rows = [json.loads(line) for line in open(os.path.join(output_dir, "ledger.jsonl"))]
    seen: dict[str, int] = {}
    groups: dict[int, set[str]] = {}
    for r in rows:
        seen[r["sample_id"]] = seen.get(r["sample_id"], 0) + 1
        groups.setdefault(r["step"], set()).add(r["sample_id"].rsplit("/", 1)[0])
    over = 0
    if max_head_offpolicyness is not None:
        over = sum(r["trained_version"] - r["version_start"] > max_head_offpolicyness for r in rows)
    lost = None
    found = recover.latest(output_dir)
    if found is not None and os.path.exists(os.path.join(found[1], "manager.json")):
        # The manager's snapshot comes first: what it counts as not yet taken is in a stream then.
        unresolved = set(recover.read_json(os.path.join(found[1], "manager.json"))["unresolved"])
        waiting = set()
        for name in os.listdir(found[1]):
            if name.startswith("model_worker-"):
                waiting |= set(recover.read_json(os.path.join(found[1], name, "worker.json"))["stream_grants"])
        lost = len(unresolved - waiting)
    return Audit(len(rows), len(groups), sum(n - 1 for n in seen.values()),
                 sorted(s for s, g in groups.items() if len(g) != batch_size), over, lost)
