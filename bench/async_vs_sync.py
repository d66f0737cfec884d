"""Trained samples per second: synchronous vs asynchronous PPO on the same model, data, batch and
machine, with long-tail generation lengths (sampling at temperature 1 up to a long max).

    python bench/async_vs_sync.py [--model smollm2-135m|tiny] [--steps 6] [--new-tokens 96]

Sync: `ppo-math` minus the reference model, 2 processes each generating then training (d2p1t1).
Async: `async-ppo-math` with 1 generation server and 1 trainer (local.d1p1t1+d1p1t1).
The ideal bound is the sync run's throughput had generation and training overlapped perfectly:
samples / max(generation time, training time) per step, both measured in the sync run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(experiment: str, args, out: str, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "realcore.launch", f"hydra.searchpath=[file://{REPO}/bench/experiments]",
           f"experiment={experiment}", "eval.freq_steps=null", f"model={args.model}", "dataset=easy-arith", f"trainer.total_steps={args.steps}",
           f"trainer.batch_size={args.batch_size}", f"generation.n_samples={args.n_samples}",
           f"generation.max_new_tokens={args.new_tokens}", "generation.temperature=1.0", "actor.max_tokens_per_mb=1024",
           f"output_dir={out}", f"system.name_resolve.root={out}/nr", *extra]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{experiment} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def steady(metrics: list[dict], key: str) -> float:
    """Mean of a per-step time, without the first step (warm-up)."""
    vals = [m.get(key, 0.0) for m in metrics[1:]] or [metrics[0].get(key, 0.0)]
    return sum(vals) / len(vals)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    args = p.parse_args()
    samples = args.batch_size * args.n_samples
    with tempfile.TemporaryDirectory() as tmp:
        sync = run("bench-sync", args, os.path.join(tmp, "sync"), ["allocation_mode=d2p1t1"])
        asyn = run("bench-async", args, os.path.join(tmp, "async"), [])
    sync_step, async_step = steady(sync, "time/step_s"), steady(asyn, "time/step_s")
    gen = steady(sync, "time/actor_gen_s")  # the generate MFC samples and scores (the rollout workflow)
    train = steady(sync, "time/actor_train_s")
    rows = [
        ("sync (d2p1t1: 2 processes, generate then train)", samples / sync_step),
        ("async (1 generation server + 1 trainer)", samples / async_step),
        ("ideal overlap of the sync run: samples / max(gen, train)", samples / max(gen, train)),
    ]
    print(f"model {args.model}, batch {args.batch_size} prompts x {args.n_samples} samples, up to {args.new_tokens} new tokens "
          f"at temperature 1, {args.steps} steps each (first step excluded)\n")
    print("| run | trained samples/s |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.2f} |")
    print(f"\nasync / sync = {sync_step / async_step:.2f}x; ideal bound = {(gen + train) / max(gen, train):.2f}x "
          f"(sync step: generation {gen:.1f} s + training {train:.1f} s; async step {async_step:.1f} s; "
          f"mean generated length sync {steady(sync, 'gen/response_len'):.0f} tokens)")


if __name__ == "__main__":
    main()
