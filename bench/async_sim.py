"""Asynchronous vs synchronous PPO at GPU-like cost: trained samples/s against the ideal bound.

    python bench/async_sim.py [--servers 1,2,4] [--etas 0,1,2,4,8] [--steps 8] [--inflight] [--keep-stale] [--quick]

What is real and what is not: every run is `python -m realcore.launch` with the real launcher,
master, dataflow graph, model workers, generation servers (HTTP API, continuous batching loop,
interruption, weight versions), gserver manager, rollout workers, reward, trajectory stream,
staleness control and weight updates (disk path, a small real model). THE COST MODEL IS THE ONLY
FAKE PART (bench/sim_costs.py, installed in every process by the experiments' `imports: [bench.sim_plugin]`): a generation server's decode
step sleeps a fixed time whatever its running batch (up to its max batch), prefill and training
sleep per token, and response lengths are drawn from a lognormal capped at max_new_tokens (a few
reach it). Sleeping, not computing, so two CPU cores are not what is measured.

Runs, for each number of servers S (M trainers, default 1):
- sync: `sim-sync` on S + M model workers (d{S+M}p1t1), each generating its share of the batch,
  then all training it (generation waits for the longest response of each process's share);
- async: `sim-async` with S servers and M trainers (local.d{S}p1t1+d{M}p1t1), for each eta
  (rollout.max_head_offpolicyness).
Trained samples/s = samples per step x steps / their time, over the `--steps` steps that follow a
run's warm-up, from the master's metrics.jsonl: the steady state of a long run. Warm-up: the first
step of a sync run; the first eta + 1 steps of an async run (admission lets up to eta + 1 batches
ahead of the trainer, and the pipeline is that deep only once the trainer has taken as many; until
then the trainer waits for the first long responses). The "all steps" column counts steps 2..N
of the same run, warm-up included.

Ideal bound of an async run, from the cost model's parameters (not measured):
min(generation alone, training alone) with its resources, in samples/s, where
- generation alone: S servers, each keeping its max batch B running: a response holds one of B
  slots for E[L] decode steps, and its prefill stops the server for E[P] tokens:
  S / (decode_step_s x E[L] / B + prefill_s_per_token x E[P]), E[L] the capped lognormal's mean
  (computed over 10,000 quantiles), E[P] the mean prompt length;
- training alone: M / (T x (train_s_per_token + logp_s_per_token)) (one PPO update and one
  proximal log-prob pass per token, spread over M data-parallel trainers), T the mean tokens of a
  TRAINED sample, counted by the trainers (their `sim:` log lines). Why not E[P] + E[L]: a batch
  takes the groups that finish first, and the stream drops samples older than eta, so trained
  samples are shorter than generated ones (the long tail is what arrives late); with E[P] + E[L]
  an async run could beat its "bound".
E[P] is measured by tokenizing the dataset's prompts. Weight updates, staleness waits, interrupted
batches and dropped samples are not in the bound: they are what the fraction shows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.sim_costs import ENV, SimCosts  # noqa: E402


def warmup(args, eta: int | None) -> int:
    """Steps left out at the start of a run: 1 (sync, eta None) or eta + 1 (async), or --warmup."""
    if args.warmup is not None:
        return args.warmup
    return 1 if eta is None else eta + 1


def warmup_text(args) -> str:
    return f"{args.warmup} steps" if args.warmup is not None else "sync 1 step, async eta + 1"


def run(experiment: str, args, out: str, costs: SimCosts, extra: list[str], warmup_steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "realcore.launch", f"hydra.searchpath=[file://{REPO}/bench/experiments]",
           f"experiment={experiment}", f"trainer.total_steps={warmup_steps + args.steps}", f"trainer.batch_size={args.batch_size}",
           f"generation.n_samples={args.n_samples}", f"generation.max_new_tokens={args.max_new_tokens}",
           f"generation.max_batch_size={args.max_batch}", f"output_dir={out}", f"system.name_resolve.root={out}/nr",
           f"trial_name=t{os.getpid()}", *extra]
    env = {**os.environ, ENV: costs.to_env(), "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{experiment} {' '.join(extra)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def steady(metrics: list[dict], warmup: int) -> list[dict]:
    """The steps after the warm-up (all of them if the run had no more)."""
    return metrics[warmup:] or metrics


def throughput(metrics: list[dict], samples: int, warmup: int) -> float:
    rows = steady(metrics, warmup)
    return samples * len(rows) / sum(m["time/step_s"] for m in rows)


def mean(metrics: list[dict], key: str, warmup: int) -> float:
    rows = steady(metrics, warmup)
    return sum(m.get(key, 0.0) for m in rows) / len(rows)


def mean_prompt_len(args) -> float:
    """E[P]: tokens of the dataset's prompts as the runs see them (tiny model, tiny-arith)."""
    from realcore.api.config import DatasetConfig, ModelConfig
    from realcore.api.registry import lookup
    from realcore.backends.models import load_tokenizer, prepare_model
    from realcore.launch.plugins import load_plugins

    load_plugins([])
    tok = load_tokenizer(prepare_model(ModelConfig(), seed=1))
    data = lookup("dataset", "tiny-arith")(DatasetConfig(type="tiny-arith"), tok, rank=0, world=1, use_chat_template=False)
    lens = [int(s["prompt_ids"][0].numel()) for s in data.samples]
    return sum(lens) / len(lens)


def bound(costs: SimCosts, args, servers: int, trainers: int, prompt_len: float,
          trained_len: float | None = None) -> tuple[float, float]:
    """(generation-alone, training-alone) samples/s with these resources (module docstring).
    `trained_len`: tokens per trained sample; None: E[P] + E[L]."""
    mean_len = costs.mean_len(args.max_new_tokens)
    gen = servers / (costs.decode_step_s * mean_len / args.max_batch + costs.prefill_s_per_token * prompt_len)
    train = trainers / ((trained_len or prompt_len + mean_len) * (costs.train_s_per_token + costs.logp_s_per_token))
    return gen, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="1,2,4", help="numbers of generation servers, comma-separated")
    p.add_argument("--trainers", type=int, default=1, help="training processes (data parallel) of async runs")
    p.add_argument("--etas", default="0,1,2,4,8", help="max_head_offpolicyness values, comma-separated")
    p.add_argument("--steps", type=int, default=8, help="measured steps per run, after its warm-up")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out at the start of each run (default: 1 for sync, eta + 1 for async)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    p.add_argument("--n-samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=32, help="a server's (and a sync process's) max running batch")
    p.add_argument("--decode-step-ms", type=float, default=20.0)
    p.add_argument("--train-us-per-token", type=float, default=None,
                   help="default: balance 2 servers with the trainers (bound = generation = training at S=2)")
    p.add_argument("--len-median", type=float, default=40.0)
    p.add_argument("--len-sigma", type=float, default=1.0)
    p.add_argument("--concurrency", type=float, default=4.0,
                   help="rollout.max_concurrent_rollouts = this x the servers' slots (S x max batch / n_samples groups): "
                   "a group holds its place until its last response ends, so with a long tail 2x left batches part empty")
    p.add_argument("--inflight", action="store_true",
                   help="async runs update the servers in flight (rollout.inflight_weight_update): running requests "
                   "go on with their KV cache instead of being interrupted and resubmitted")
    p.add_argument("--keep-stale", action="store_true",
                   help="async runs keep what arrives past eta (rollout.drop_stale=false, AReaL's bound: admission "
                   "alone): nothing is dropped or cancelled, a slow rollout is trained staler than eta")
    p.add_argument("--out", default=None, help="keep every run's output folder here (default: a temporary folder)")
    p.add_argument("--quick", action="store_true", help="smoke run: eta 2, 1 server, 2 steps, tiny sizes")
    args = p.parse_args()
    if args.quick:
        args.servers, args.etas, args.steps, args.batch_size, args.max_new_tokens = "1", "2", 1, 2, 16
        args.decode_step_ms, args.len_median = 2.0, 4.0
    servers = [int(s) for s in args.servers.split(",")]
    etas = [int(e) for e in args.etas.split(",")]
    samples = args.batch_size * args.n_samples
    prompt_len = mean_prompt_len(args)
    costs = SimCosts(decode_step_s=args.decode_step_ms / 1000, len_median=args.len_median, len_sigma=args.len_sigma)
    if args.train_us_per_token is not None:
        train_s = args.train_us_per_token / 1e6
    else:  # training alone exactly as fast as 2 servers alone (a log-prob pass costs a third of training)
        gen2, _ = bound(costs, args, 2, args.trainers, prompt_len)
        train_s = 0.75 * args.trainers / (gen2 * (prompt_len + costs.mean_len(args.max_new_tokens)))
    costs = SimCosts(**{**costs.__dict__, "train_s_per_token": train_s, "logp_s_per_token": train_s / 3})
    mean_len = costs.mean_len(args.max_new_tokens)
    print(f"cost model: decode step {costs.decode_step_s * 1e3:g} ms at any batch up to {args.max_batch}, prefill "
          f"{costs.prefill_s_per_token * 1e6:g} us/token, training {costs.train_s_per_token * 1e6:.0f} + log-probs "
          f"{costs.logp_s_per_token * 1e6:.0f} us/token; response length lognormal(median {costs.len_median:g}, sigma "
          f"{costs.len_sigma:g}) capped at {args.max_new_tokens}: mean {mean_len:.1f}; mean prompt {prompt_len:.1f} "
          f"tokens. {args.batch_size} prompts x {args.n_samples} samples per step, {args.steps} measured steps per run "
          f"after its warm-up ({warmup_text(args)}), {args.trainers} trainer(s).\n", flush=True)
    rows = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="async_sim-") as tmp:
        tmp = args.out or tmp
        for s in servers:
            world = s + args.trainers
            out = os.path.join(tmp, f"sync-{world}")
            w = warmup(args, None)
            sync = run("sim-sync", args, out, costs, [f"allocation_mode=d{world}p1t1"], w)
            sync_tp = throughput(sync, samples, w)
            rows.append([f"sync, {world} processes (d{world}p1t1)", f"{sync_tp:.2f}", f"{throughput(sync, samples, 1):.2f}",
                         "", "", "1.00x", f"{mean(sync, 'time/actor_gen_s', w):.2f} (generate)", "", "", "", "",
                         f"{trained_tokens_per_sample(out) - prompt_len:.1f}"])
            for eta in etas:
                out = os.path.join(tmp, f"async-{s}-{eta}")
                w = warmup(args, eta)
                asyn = run("sim-async", args, out, costs,
                           [f"allocation_mode=local.d{s}p1t1+d{args.trainers}p1t1", f"rollout.max_head_offpolicyness={eta}",
                            f"rollout.max_concurrent_rollouts={max(1, round(args.concurrency * s * args.max_batch / args.n_samples))}",
                            f"rollout.inflight_weight_update={str(args.inflight).lower()}",
                            f"rollout.drop_stale={str(not args.keep_stale).lower()}"], w)
                tp = throughput(asyn, samples, w)
                busy, batch, refill = server_usage(out, s)
                trained_len = trained_tokens_per_sample(out)
                ideal = min(bound(costs, args, s, args.trainers, prompt_len, trained_len))
                mode = (", in-flight updates" if args.inflight else "") + (", stale kept" if args.keep_stale else "")
                heads = [m["staleness/head"] for m in steady(asyn, w)]
                rows.append([f"async, {s} server{'s' if s > 1 else ''} + {args.trainers} trainer, eta {eta}{mode}", f"{tp:.2f}",
                             f"{throughput(asyn, samples, 1):.2f}", f"{ideal:.2f}", f"{tp / ideal:.0%}", f"{tp / sync_tp:.2f}x",
                             f"{mean(asyn, 'time/stream_wait_s', w):.2f}", f"{mean(asyn, 'time/weight_update_s', w):.2f}",
                             f"{mean(asyn, 'staleness/dropped', w):.1f} / {mean(asyn, 'rollout/stale_cancelled', w):.1f}",
                             f"{sum(heads) / len(heads):.1f} / {max(heads)}", f"{busy:.0%}, {batch:.1f}, {refill:.2f} s",
                             f"{trained_len - prompt_len:.1f}"])
                print(f"  [{time.monotonic() - t_start:.0f} s] {rows[-1][0]}: {tp:.2f} samples/s", file=sys.stderr, flush=True)
    print("| setting | trained samples/s | all steps | ideal bound | fraction of bound | vs sync | stream wait s/step | "
          "weight update s/step | stale groups /step: dropped at take / cancelled | staleness trained: mean / max | "
          "servers: busy, mean batch, refill | trained response len |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    gen1, train1 = bound(costs, args, 1, args.trainers, prompt_len)
    print(f"\nideal bound = min(generation alone, training alone): one server alone {gen1:.2f} samples/s, "
          f"{args.trainers} trainer alone {train1:.2f} samples/s. Rates and per-step columns are over the measured "
          f"steps (after the warm-up), 'all steps' over steps 2..N; 'cancelled': groups a weight update made certain "
          f"to be dropped, stopped there by their rollout worker; 'staleness trained' each step's oldest sample "
          f"(staleness/head: the trained version minus its first token's), mean and max over the steps; "
          f"'busy' is the time servers spend in (simulated) decode and prefill over the run, 'mean batch' their "
          f"mean running batch (max {args.max_batch}), 'refill' the time from an interruption (a weight update's "
          f"pause) until a server's batch was back to its size; 'trained response len' the mean response tokens "
          f"of the trained samples (all generated: {mean_len:.1f}).")


def server_usage(out: str, n_servers: int) -> tuple[float, float, float]:
    """(busy fraction, mean running batch, seconds from an interruption until the batch was back),
    averaged over the servers, from the last `sim:` line of each server's log."""
    rows = []
    for i in range(n_servers):
        lines = [ln for ln in open(os.path.join(out, "logs", f"gen_server-{i}.log")) if "sim: " in ln]
        m = re.search(r"mean running batch ([\d.]+), busy ([\d.]+) s of ([\d.]+) s.*; \d+ interruptions, ([\d.]+) s",
                      lines[-1]) if lines else None
        if m:
            rows.append((float(m[2]) / max(float(m[3]), 1e-9), float(m[1]), float(m[4])))
    return tuple(sum(r[k] for r in rows) / len(rows) for k in range(3)) if rows else (0.0, 0.0, 0.0)


def trained_tokens_per_sample(out: str) -> float:
    """Mean tokens (prompt + response) of the samples the trainers trained on (their `sim:` lines)."""
    seqs = tokens = 0
    for name in os.listdir(os.path.join(out, "logs")):
        if name.startswith("model_worker"):
            for m in re.finditer(r"sim: trained (\d+) sequences, (\d+) tokens", open(os.path.join(out, "logs", name)).read()):
                seqs, tokens = seqs + int(m[1]), tokens + int(m[2])
    return tokens / max(seqs, 1)


if __name__ == "__main__":
    main()
