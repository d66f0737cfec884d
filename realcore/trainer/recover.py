"""Recover checkpoints: everything a run needs to continue exactly, written atomically.

Layout: `OUTPUT_DIR/recover/step_N/` holds `master.json` (MasterState), `manager.json` (the
admission state, async mode) and one folder per model worker (`model_worker-I/`: engine state of
each trainable role, RNG, data position, the trajectories waiting in its stream). A checkpoint is
written into `recover/.tmp-step_N-PID/`, every file and folder fsynced, then renamed to `step_N`:
a folder named `step_N` is always complete, and a half-written one is never loaded. Older
checkpoints are removed once a newer one is in place. The same step saved again (a resumed run
preempted at once) swaps the folders (system/durable.py); where the filesystem cannot swap, the old
one waits as `.old-step_N-PID` for a moment, and `latest` finds it there if the writer died then.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field

from realcore.transport.durable import replace_dir

_STEP_DIR = re.compile(r"^step_(\d+)$")
_ASIDE_DIR = re.compile(r"^\.old-step_(\d+)-\d+$")  # a complete step_N swapped out (durable.replace_dir)


@dataclass
class MasterState:
    """The master's part: where the run is, and what its batch source keeps (batch_source.py)."""

    step: int
    version: int
    next_id: int
    source: dict = field(default_factory=dict)


def root(output_dir: str) -> str:
    return os.path.join(output_dir, "recover")


def latest(output_dir: str) -> tuple[int, str] | None:
    """(step, path) of the newest complete recover checkpoint, or None. A `step_N` first; an old
    step_N that its writer had moved aside when it died (the new one not yet in place) next."""
    try:
        names = os.listdir(root(output_dir))
    except FileNotFoundError:
        return None
    found = [(int(m.group(1)), 1, name) for name in names if (m := _STEP_DIR.match(name))]
    found += [(int(m.group(1)), 0, name) for name in names if (m := _ASIDE_DIR.match(name))]
    if not found:
        return None
    step, _, name = max(found)
    return step, os.path.join(root(output_dir), name)


def begin(output_dir: str, step: int) -> str:
    """A fresh temporary folder to write checkpoint `step` into (left-overs of a dead writer go)."""
    os.makedirs(root(output_dir), exist_ok=True)
    for name in os.listdir(root(output_dir)):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root(output_dir), name), ignore_errors=True)
    tmp = os.path.join(root(output_dir), f".tmp-step_{step}-{os.getpid()}")
    os.makedirs(tmp)
    return tmp


def commit(tmp: str, output_dir: str, step: int) -> str:
    """fsync everything in `tmp`, make it step_N (replacing a step_N saved before: a resumed
    run), then drop older checkpoints: at every moment one complete checkpoint is found by `latest`."""
    final = os.path.join(root(output_dir), f"step_{step}")
    replace_dir(tmp, final, os.path.join(root(output_dir), f".old-step_{step}-{os.getpid()}"))
    for name in os.listdir(root(output_dir)):
        m = _STEP_DIR.match(name) or _ASIDE_DIR.match(name)
        if m and (int(m.group(1)) < step or name.startswith(".old-")):
            shutil.rmtree(os.path.join(root(output_dir), name), ignore_errors=True)
    return final


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj, f)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def truncate_jsonl(path: str, max_step: int) -> int:
    """Keep the rows of a per-step jsonl file (metrics, ledger) with step <= max_step; rows of a
    failed attempt after the checkpoint go, so a resumed run writes each step once. A torn last
    line (the writer was killed mid-line) goes too. Returns the rows kept."""
    if not os.path.exists(path):
        return 0
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= max_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(kept)
