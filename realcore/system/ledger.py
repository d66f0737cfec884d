"""`OUTPUT_DIR/ledger.jsonl`: one line per trained sequence, so users (and tests) can see that no
sample was trained twice or lost, and that staleness stayed within its bound, across restarts.

A row: `step`, `sample_id` ("{shard}:{seq}/{j}": which prompt of which data shard, which of its n
samples; stable across restarts), `version_start` / `version_end` (the policy versions that
generated it) and `trained_version` (the version the update that used it started from).
"""

from __future__ import annotations

import json
import os

from realcore.system.recover import truncate_jsonl


class Ledger:
    def __init__(self, output_dir: str, *, resume_step: int):
        """Continue after `resume_step` (0: a new run): rows of later steps are dropped first."""
        self.path = os.path.join(output_dir, "ledger.jsonl")
        if resume_step == 0 and os.path.exists(self.path):
            os.remove(self.path)
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
