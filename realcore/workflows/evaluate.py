"""Evaluation of the policy on held-out prompts (`eval:` config, realcore.api.config.EvalConfig).

Each prompt runs the rollout workflow twice: once greedily with one sample (eval/accuracy: reward
> 0; eval/reward: the mean reward) and once sampled with `eval.n_samples` samples (eval/pass@k, k =
n_samples: any sample has reward > 0; n_samples 0 skips this pass). The same code runs wherever the engine is: in `python -m
realcore.eval` and on the actor (a `BatchingEngine`), or on the generation servers during an async
run (`ServerEngine`s); the caller says how to build an engine for a sampling config.

An episode that raises, returns None or returns a malformed trajectory counts in eval/failed and
as a wrong answer (reward 0): a broken workflow must not look like an accurate policy.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from realcore.api.config import DatasetConfig, ExperimentConfig, GenerationConfig
from realcore.api.registry import lookup, workflow_keys
from realcore.api.workflow import EpisodeOutcome, RolloutEngine, workflow_data
from realcore.backends.models import load_tokenizer
from realcore.data.datasets import held_out
from realcore.workflows import sandbox
from realcore.workflows.episode import EpisodeResult, Workflow, run_episodes

log = logging.getLogger("realcore.eval")

# Episodes in flight against generation servers at once: enough to fill a server's batch, few
# enough not to starve the training rollouts that share the servers.
MAX_CONCURRENT = 32
_LOGGED_FAILURES = 3  # per pass; the rest are only counted


def eval_dataset(cfg: ExperimentConfig) -> DatasetConfig:
    """`eval.dataset`, or the training dataset's config with seed + size: a draw disjoint from
    training's (reasoning-gym's item i comes from seed + i, so seed + 1 would be the training set
    shifted by one); a jsonl file is the same file: give a held-out one. `eval_rows` leaves out
    every prompt whose question is also in the training dataset."""
    return cfg.eval.dataset or cfg.dataset.model_copy(update={"seed": cfg.dataset.seed + cfg.dataset.size})


def eval_rows(cfg: ExperimentConfig, tokenizer=None) -> list[dict[str, Any]]:
    """The first `eval.n_prompts` rows of `eval_dataset(cfg)`, as workflow `data`. `tokenizer`:
    the policy's (default: loaded from model.path). ValueError when the dataset cannot be loaded
    or holds no prompts."""
    dcfg = eval_dataset(cfg)
    if dcfg.format != "rl":
        raise ValueError(f"eval.dataset: format={dcfg.format!r}; evaluation needs prompts (format=rl)")
    if tokenizer is None:
        if cfg.model.path is None:
            raise ValueError("eval: model.path is not resolved (prepare_model first) and no tokenizer was given")
        tokenizer = load_tokenizer(cfg.model.path)
    def load(d: DatasetConfig):
        return lookup("dataset", d.type)(d, tokenizer, rank=0, world=1, use_chat_template=cfg.model.use_chat_template)

    # dataset.holdout chooses what training leaves out: evaluation sees every question.
    loaded = load(dcfg.model_copy(update={"holdout": 0.0}))
    # Held out means never trained on: a new draw of a small generated dataset repeats some of its
    # problems, and a user's file may share rows with the training file. A question drawn twice is
    # evaluated once.
    rows = [workflow_data(s) for s in loaded.samples]
    trained = {workflow_data(s).get("question") for s in load(cfg.dataset).samples} if cfg.dataset.format == "rl" else set()
    # With dataset.holdout, an evaluation of the same task sees only the questions it held out.
    t = cfg.dataset
    only_held_out = t.holdout > 0 and (dcfg.type, dcfg.path, dcfg.task, dcfg.task_kwargs) == (t.type, t.path, t.task, t.task_kwargs)
    kept, seen = [], set(trained)
    for r in rows:
        q = r.get("question")
        if only_held_out and (q is None or not held_out(q, t.holdout)):
            continue
        if q is None or q not in seen:
            kept.append(r)
            seen.add(q)
    if len(kept) < len(rows):
        log.info("eval: %d of %d held-out prompts are training prompts or repeats: left out", len(rows) - len(kept), len(rows))
    if not kept:
        raise ValueError(f"eval.dataset: {dcfg.type!r} gave no usable prompts ({loaded.n_rows} rows, "
                         f"{loaded.n_skipped} skipped, {len(rows)} also in the training dataset)")
    if "prompt_ids" not in kept[0]:
        raise ValueError(f"eval.dataset: {dcfg.type!r} rows carry {sorted(kept[0])}, not prompt_ids")
    return kept[: cfg.eval.n_prompts]


def eval_gconfigs(cfg: ExperimentConfig) -> tuple[GenerationConfig, GenerationConfig]:
    """(greedy, sampled) sampling configs: the run's `generation:` with eval's overrides."""
    g, e = cfg.generation, cfg.eval
    max_new = e.max_new_tokens or g.max_new_tokens
    greedy = g.model_copy(update={"greedy": True, "n_samples": 1, "max_new_tokens": max_new})
    sampled = g.model_copy(update={"greedy": False, "n_samples": e.n_samples, "max_new_tokens": max_new,
                                   "temperature": e.temperature or g.temperature})
    return greedy, sampled


def _groups(results: list[EpisodeResult], name: str) -> tuple[list[dict | None], int]:
    """Episode results -> ({key: one tensor per sequence} or None for a failed episode, failures)."""
    out, failed = [], 0
    for i, r in enumerate(results):
        if r.outcome is EpisodeOutcome.DONE:
            out.append(r.group)
            continue
        failed += 1
        out.append(None)
        if failed <= _LOGGED_FAILURES:
            log.warning("eval (%s): episode of prompt %d failed: %s", name, i, r.why())
    return out, failed


async def evaluate(cfg: ExperimentConfig, episode: Workflow, make_engine: Callable[[GenerationConfig], RolloutEngine],
                   rows: list[dict]) -> dict[str, float]:
    """The eval metrics of the policy behind `make_engine(gconfig)` on `rows` (see the module
    docstring). `episode`: the workflow (`make_workflow(cfg.rollout.workflow, ...)`). Each pass must
    finish within system.request_timeout_s (the deadline of one MFC call); episodes still running
    then are cancelled and counted as failed."""
    if not rows:
        raise ValueError("evaluate: no prompts")
    with sandbox.node_bound(sandbox.node_slots_folder(cfg.output_dir), cfg.rollout.max_concurrent_tool_calls):
        return await _evaluate(cfg, episode, make_engine, rows)


async def _evaluate(cfg: ExperimentConfig, episode: Workflow, make_engine: Callable[[GenerationConfig], RolloutEngine],
                    rows: list[dict]) -> dict[str, float]:
    t0 = time.monotonic()
    keys = workflow_keys(cfg.rollout.workflow)
    greedy_g, sampled_g = eval_gconfigs(cfg)
    timeout = cfg.system.request_timeout_s

    async def run_pass(gconfig: GenerationConfig) -> list[EpisodeResult]:
        return await run_episodes(episode, make_engine(gconfig), rows, keys, deadline=time.monotonic() + timeout,
                                  max_concurrent=MAX_CONCURRENT)

    greedy, n_failed_greedy = _groups(await run_pass(greedy_g), "greedy")
    sampled, n_failed_sampled = [], 0
    if cfg.eval.n_samples > 0:  # 0: the greedy pass only
        sampled, n_failed_sampled = _groups(await run_pass(sampled_g), "sampled")

    def rewards(g: dict | None) -> list[float]:
        return [float(r) for r in g["rewards"]] if g is not None else [0.0]  # a failed episode scores 0

    # A workflow returns a group even for one sample; a prompt's greedy reward is its group's mean.
    greedy_reward = [sum(rewards(g)) / len(rewards(g)) for g in greedy]
    lens = [int(m.sum()) for g in greedy if g is not None for m in g["loss_mask"]]
    n = len(rows)
    out = {
        "eval/accuracy": sum(r > 0 for r in greedy_reward) / n,
        "eval/reward": sum(greedy_reward) / n,
        "eval/n_prompts": float(n),
        "eval/response_len": sum(lens) / len(lens) if lens else 0.0,
        "eval/failed": float(n_failed_greedy + n_failed_sampled),
        "eval/time_s": time.monotonic() - t0,
    }
    if cfg.eval.n_samples > 0:
        out[f"eval/pass@{cfg.eval.n_samples}"] = sum(any(r > 0 for r in rewards(g)) for g in sampled) / n
    return out
