"""Concurrent MFCs: three independent inference MFCs (roles ref, ref2, ref3) after one cheap
producer, each role on a training mesh of its own (allocation_mode
actor:d1p1t1,ref:d1p1t1,ref2:d1p1t1,ref3:d1p1t1) vs the three colocated on one mesh (d1p1t1).

    python bench/concurrency.py [--steps 5] [--length 256] [--batch-size 16] [--quick]

Colocated, the master sends the three one after another (one mesh runs one MFC at a time): the
step's inference takes their sum. On three meshes they run at the same time: about the longest.
"alone" is each MFC's own time in the colocated run; "inference span" is from the first of the
three starting to the last ending (metrics timeline/*), "step" the whole step; means over the
steps after the first (warm-up). Each worker computes on one thread, so three meshes need three
free cores to show the overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MFCS = ("ref_inf", "ref2_inf", "ref3_inf")
MESHES = "actor:d1p1t1,ref:d1p1t1,ref2:d1p1t1,ref3:d1p1t1"


def run(args, out: str, allocation_mode: str) -> list[dict]:
    cmd = [sys.executable, "-m", "realcore.launch", f"hydra.searchpath=[file://{REPO}/bench/experiments]",
           "experiment=bench-concurrency", "model=tiny", f"model.tiny.hidden_size={args.hidden}",
           f"model.tiny.intermediate_size={2 * args.hidden}", f"model.tiny.num_hidden_layers={args.layers}",
           f"trainer.total_steps={args.steps}", f"trainer.batch_size={args.batch_size}", f"mfcs.0.args.length={args.length}",
           f"allocation_mode={allocation_mode}", f"output_dir={out}", f"model.cache_dir={args.cache}",
           f"system.name_resolve.root={out}/nr", f"trial_name=concurrency-{os.path.basename(out)}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"allocation_mode={allocation_mode} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def steady(metrics: list[dict], value) -> float:
    """Mean of value(step's metrics) over the steps after the first (warm-up)."""
    rows = metrics[1:] or metrics
    return sum(value(m) for m in rows) / len(rows)


def span(m: dict) -> float:
    return max(m[f"timeline/{n}_end_s"] for n in MFCS) - min(m[f"timeline/{n}_start_s"] for n in MFCS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--length", type=int, default=256, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=256, help="the tiny model's width")
    p.add_argument("--layers", type=int, default=4, help="the tiny model's layers")
    p.add_argument("--quick", action="store_true", help="a small, short run (tests): the table, not the timings")
    args = p.parse_args()
    if args.quick:
        args.steps, args.batch_size, args.length, args.hidden, args.layers = 2, 4, 16, 64, 2
    with tempfile.TemporaryDirectory() as tmp:
        args.cache = os.path.join(tmp, "cache")
        colocated = run(args, os.path.join(tmp, "colocated"), "d1p1t1")
        meshes = run(args, os.path.join(tmp, "meshes"), MESHES)
    alone = {n: steady(colocated, lambda m, n=n: m[f"time/{n}_s"]) for n in MFCS}
    print(f"tiny model (hidden {args.hidden}, {args.layers} layers), {args.batch_size} sequences x {args.length} tokens "
          f"per step, {args.steps} steps each (first excluded)\n")
    print("| | seconds |\n|---|---|")
    for n in MFCS:
        print(f"| {n} alone | {alone[n]:.3f} |")
    print(f"| sum of the three | {sum(alone.values()):.3f} |")
    print(f"| longest of the three | {max(alone.values()):.3f} |")
    print(f"| inference span, colocated (d1p1t1) | {steady(colocated, span):.3f} |")
    print(f"| inference span, three meshes ({MESHES}) | {steady(meshes, span):.3f} |")
    print(f"| step, colocated | {steady(colocated, lambda m: m['time/step_s']):.3f} |")
    print(f"| step, three meshes | {steady(meshes, lambda m: m['time/step_s']):.3f} |")


if __name__ == "__main__":
    main()
