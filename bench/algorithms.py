"""Every algorithm's experiment on the same task, side by side: does each one learn, and at what cost.

    python bench/algorithms.py [--seeds 2] [--steps 20] [--algorithms grpo,rloo,...] [--out DIR]
    python bench/algorithms.py --quick     # the tiny random model, 3 steps, 1 seed: a smoke run

Each algorithm is its experiment YAML in experiments/experiment/ (one per algorithm: the update MFC's
`args:` pick the advantage estimator, the policy loss and the corrections; docs/ppo.md). Every run
gets the same model (SmolLM2-135M), data (easy arithmetic with half of its distinct questions held
out), batch, sampling, learning rate and seed on the command line (bench/learning.py's
`common_overrides`), so the algorithm is the only difference.

For each run: the training reward (`reward/mean`) averaged over the first and the last k steps,
the greedy accuracy on the held-out questions of the base model and of the final checkpoint
(realcore.eval, as bench/learning.py), the critic's value loss first and last step where the
experiment has a critic (`critic/value_loss`), and the mean time per step (`time/step_s`).
Prints one table (mean ± half the range over seeds), writes DIR/algorithms.png (reward curves and
held-out accuracy) and DIR/results.json. Exit code 0 when every run exited 0 and every
evaluation finished; 1 otherwise (the table still prints what there is).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

import learning  # noqa: E402  (bench/learning.py: launch, curves, evaluation, table helpers)
from learning import ROOT, HOLDOUT, fmt  # noqa: E402

# name -> experiment (experiments/experiment/NAME.yaml) and what it is
ALGORITHMS = {
    "grpo": ("grpo-math", "GRPO: group-normalised outcome advantage, PPO clip"),
    "dr-grpo": ("dr-grpo-math", "Dr. GRPO: centred advantage, no std, seq-mean-token-sum"),
    "rloo": ("rloo-math", "RLOO: leave-one-out baseline"),
    "reinforce++": ("reinforce-pp-math", "REINFORCE++: batch-normalised return"),
    "reinforce++-baseline": ("reinforce-pp-baseline-math", "REINFORCE++ with the group mean as baseline"),
    "dapo": ("dapo-math", "DAPO: clip-higher, token-mean, overlong shaping"),
    "gspo": ("gspo-math", "GSPO: sequence-level ratio"),
    "cispo": ("cispo-math", "CISPO: clipped IS weight"),
    "sapo": ("sapo-math", "SAPO: soft gate instead of the clip"),
    "ppo-critic": ("ppo-critic-math", "PPO with a critic: GAE, KL in the reward"),
}


def experiment_path(name: str) -> str:
    return os.path.join(ROOT, "experiments", "experiment", f"{name}.yaml")


def train(algo: str, seed: int, args) -> dict:
    """One launch of `algo`'s experiment; learning.train does the launching, under our own settings."""
    learning.SETTINGS[algo] = (ALGORITHMS[algo][1], ALGORITHMS[algo][0], [])
    run = learning.train(algo, seed, args)
    run["algorithm"] = algo
    run["step_s"], run["value_loss"] = per_step(run["dir"])
    return run


def per_step(out: str) -> tuple[list[float], list[float]]:
    """Per step: time/step_s and (where there is a critic) critic/value_loss."""
    from realcore.plot import read_metrics

    path = os.path.join(out, "metrics.jsonl")
    rows = [r for r in read_metrics(path) if "time/step_s" in r] if os.path.exists(path) else []
    return [r["time/step_s"] for r in rows], [r["critic/value_loss"] for r in rows if "critic/value_loss" in r]


def table(runs: list[dict], before: dict[int, dict]) -> str:
    done = [r for r in runs if r["rc"] == 0 and r["reward"]]
    k = max(1, min(5, min((len(r["reward"]) for r in done), default=0) // 2))
    head = ["algorithm", "seeds ok", f"reward first {k}", f"reward last {k}", "held-out accuracy before -> after",
            "value loss first -> last", "time per step (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for algo in dict.fromkeys(r["algorithm"] for r in runs):
        rs = [r for r in runs if r["algorithm"] == algo]
        ok = [r for r in rs if r in done]
        critic = [r for r in ok if r["value_loss"]]
        vl = f"{fmt([r['value_loss'][0] for r in critic], 3)} -> {fmt([r['value_loss'][-1] for r in critic], 3)}" if critic else "-"
        lines.append("| " + " | ".join([
            algo, f"{len(ok)}/{len(rs)}", fmt([sum(r["reward"][:k]) / k for r in ok], 3),
            fmt([sum(r["reward"][-k:]) / k for r in ok], 3),
            f"{fmt([before[r['seed']]['held-out'] for r in rs])} -> {fmt([r['after'].get('held-out') for r in rs])}",
            vl, fmt([sum(r["step_s"]) / len(r["step_s"]) for r in ok if r["step_s"]], 1)]) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], before: dict[int, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    algos = list(dict.fromkeys(r["algorithm"] for r in runs))
    for i, algo in enumerate(algos):
        ok = [r for r in runs if r["algorithm"] == algo and r["rc"] == 0 and r["reward"]]
        if ok:
            grid, mean, lo, hi = learning.band(ok, "step")
            axes[0].plot(grid, mean, color=f"C{i % 10}", label=algo, ls="-" if i < 10 else "--")
            axes[0].fill_between(grid, lo, hi, color=f"C{i % 10}", alpha=0.12)
        accs = [a for a in (r["after"].get("held-out") for r in runs if r["algorithm"] == algo) if a is not None]
        if accs:
            m = sum(accs) / len(accs)
            axes[1].bar(i, m, color=f"C{i % 10}", yerr=[[m - min(accs)], [max(accs) - m]], capsize=4)
    base = [b["held-out"] for b in before.values() if b.get("held-out") is not None]
    if base:
        axes[1].axhline(sum(base) / len(base), color="gray", ls="--", label="base model")
        axes[1].legend(fontsize=8)
    axes[0].set(title="training reward (mean, min-max over seeds)", xlabel="step", ylabel="reward/mean")
    axes[1].set(title="held-out greedy accuracy after training", ylabel="eval/accuracy", xticks=range(len(algos)))
    axes[1].set_xticklabels(algos, rotation=30, ha="right")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(-0.03, 1.03)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, help="seeds per algorithm (default 2; --quick 1)")
    p.add_argument("--steps", type=int, help="training steps of every run (default 20; --quick 3)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset of " + ",".join(ALGORITHMS))
    p.add_argument("--out", help="folder of the runs, algorithms.png and results.json (default outputs/algorithms/TIME-PID)")
    p.add_argument("--quick", action="store_true", help="the tiny random model on tiny-arith: a smoke run")
    p.add_argument("--batch-size", type=int, help="prompts per step (default 6; --quick 2)")
    p.add_argument("--n-samples", type=int, default=4, help="samples per prompt (the group)")
    p.add_argument("--new-tokens", type=int, help="generation.max_new_tokens (default 32; --quick 8)")
    p.add_argument("--lr", type=float, default=2e-5, help="the actor's learning rate (constant)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts evaluated (default 100; --quick 4)")
    p.add_argument("--run-timeout", type=float, help="seconds one launch may take (default 300 + 180 per step)")
    args = p.parse_args(argv)
    for name, real, tiny in (("seeds", 2, 1), ("steps", 20, 3), ("batch_size", 6, 2), ("new_tokens", 32, 8),
                             ("eval_prompts", 100, 4)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.quick else real)
    args.model, args.dataset = ("tiny", "tiny-arith") if args.quick else ("smollm2-135m", "easy-arith")
    args.run_timeout = args.run_timeout or 300 + 180 * args.steps
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad or not args.algorithms:
        p.error(f"--algorithms: {bad[0] if bad else '(empty)'} is not one of {','.join(ALGORITHMS)}")
    missing = [a for a in args.algorithms if not os.path.isfile(experiment_path(ALGORITHMS[a][0]))]
    if missing:
        p.error(f"--algorithms: {missing[0]}'s experiment {experiment_path(ALGORITHMS[missing[0]][0])} does not exist")
    if min(args.seeds, args.steps, args.batch_size, args.new_tokens, args.eval_prompts) < 1 or args.n_samples < 2:
        p.error("--seeds, --steps, --batch-size, --new-tokens and --eval-prompts must be >= 1, --n-samples >= 2")
    args.gsm8k = 0
    args.out = os.path.abspath(args.out or os.path.join(ROOT, "outputs", "algorithms", f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    names = [f"{a}-s{s}" for s in range(1, args.seeds + 1) for a in args.algorithms]
    taken = [n for n in names if os.path.exists(os.path.join(args.out, "runs", n))]
    if taken:
        sys.exit(f"algorithms.py: {args.out} already holds run {taken[0]}: pick another --out")
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    import torch

    torch.set_num_threads(1)
    print(f"model {args.model}, data {args.dataset} without the held-out {HOLDOUT:.0%} of its questions, {args.steps} steps "
          f"x {args.batch_size} prompts x {args.n_samples} samples, up to {args.new_tokens} new tokens, lr {args.lr}; "
          f"algorithms: {', '.join(args.algorithms)}; output in {args.out}", flush=True)
    failures: list[str] = []
    before = learning.evaluate_bases(args, failures)
    runs = []
    for seed in range(1, args.seeds + 1):  # seed-major: a cut-short benchmark still has whole seeds
        for algo in args.algorithms:
            run = learning.evaluate_run(train(algo, seed, args), f"{algo}-s{seed}", args, failures)
            runs.append(run)
            print(f"{algo}-s{seed}: exit {run['rc']}, {run['wall_s']:.0f} s, reward {[round(x, 3) for x in run['reward']]}, "
                  f"after {run['after']}", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "before": before, "runs": runs}, f, indent=1)
    png = os.path.join(args.out, "algorithms.png")
    plot(runs, before, png)
    print()
    print(table(runs, before))
    print(f"\n± half the range over seeds; held-out: greedy accuracy on questions never trained on. Wrote {png} and "
          f"{os.path.join(args.out, 'results.json')}")
    bad_runs = [f"{r['algorithm']}-s{r['seed']} exited {r['rc']}" for r in runs if r["rc"] != 0]
    for line in bad_runs + failures:
        print(f"algorithms.py: {line}", file=sys.stderr)
    return 1 if bad_runs or failures else 0


if __name__ == "__main__":
    sys.exit(main())
