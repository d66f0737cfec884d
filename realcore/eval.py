"""Evaluate a policy on held-out prompts, in one process, without a cluster (docs/evaluation.md).

    python -m realcore.eval OUTPUT_DIR [key=value ...]
    python -m realcore.eval model=tiny dataset=tiny-arith eval.n_prompts=8
    python -m realcore.eval experiment=async-ppo-math model.path=OUTPUT_DIR/checkpoints/step_N

OUTPUT_DIR: a run's folder. Its last checkpoint (checkpoints/step_N, the largest N) is evaluated
with the run's own settings, read from the config.json the run saved there (model, dataset and its
holdout, generation, eval, chat template, seed, imports), so it prints the figures the run's own
evaluation would print after that step. `key=value` after it changes that config (a dotted key and
a YAML value, e.g. eval.n_prompts=64).

Otherwise the arguments are `key=value` overrides, composed as `python -m realcore.launch` composes
them (the same hydra tree; experiment ppo-math by default), so `rollout.workflow`, `reward.type`,
`generation.*`, `eval.*` and `imports=[...]` mean what they mean in a run. The policy is
`model.path` (any HF directory, e.g. a run's checkpoints/step_N) or `model.name` (tiny,
smollm2-135m), decoded by the built-in generation engine; rewards run in the reward runner's child
processes, as in a run. The held-out prompts are a new draw of the training dataset (seed + size)
unless `eval.dataset` names others: a jsonl training file needs `eval.dataset` (a held-out file).

Prints the metrics as a table, then one JSON line. Exit codes: 0 done (episodes that failed are
counted in eval/failed, not fatal); 1 the evaluation itself broke (a traceback); 2 bad config,
run folder, model, dataset, workflow or reward (one line, no traceback); 130 interrupted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

import pydantic
import yaml
from transformers.utils import logging as hf_logging

import realcore.workflows  # noqa: F401  (the built-in workflows register on import)
from realcore.backends.generation import GenerationEngine
from realcore.backends.models import check_model_dir, load_model, load_tokenizer, prepare_model
from realcore.backends.onednn_linear import use_onednn
from realcore.api.config import ExperimentConfig
from realcore.launch.chat_template import resolve_chat_template
from realcore.launch.config_loader import ConfigError, format_validation_error, import_user_modules, load_config
from realcore.workflows.engines import BatchingEngine
from realcore.workflows.episode import reward_fn, workflow_of
from realcore.workflows.evaluate import eval_dataset, eval_rows, evaluate
from realcore.workflows.reward_runner import reward_runner_for


def _table(metrics: dict[str, float]) -> str:
    width = max(len(k) for k in metrics)
    return "\n".join(f"{k:<{width}}  {v:.4g}" for k, v in metrics.items())


def last_checkpoint(output_dir: str) -> str:
    """OUTPUT_DIR/checkpoints/step_N with the largest N (the policy's HF folder; with LoRA its
    `merged/` export); ValueError when there is none."""
    root = os.path.join(output_dir, "checkpoints")
    steps = sorted(int(name[5:]) for name in (os.listdir(root) if os.path.isdir(root) else [])
                   if name.startswith("step_") and name[5:].isdigit())
    if not steps:
        raise ValueError(f"{output_dir}: no checkpoint (checkpoints/step_N) in this run folder")
    path = os.path.join(root, f"step_{steps[-1]}")
    if os.path.isfile(os.path.join(path, "adapter_config.json")):  # a LoRA adapter: its merged export, if any
        if not os.path.isfile(os.path.join(path, "merged", "config.json")):
            raise ValueError(f"{path} is a LoRA adapter without merged/ (actor.lora.export_merged=true writes it)")
        path = os.path.join(path, "merged")
    return path


def run_config(output_dir: str, overrides: list[str]) -> ExperimentConfig:
    """The config a run saved in OUTPUT_DIR/config.json, `overrides` (dotted key=YAML value)
    applied, its policy the run's last checkpoint; ValueError for a folder that is not a run's."""
    path = os.path.join(output_dir, "config.json")
    if not os.path.isdir(output_dir):
        raise ValueError(f"{output_dir}: no such run folder (give OUTPUT_DIR, or key=value overrides)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{output_dir}: no config.json (not a run's output folder)") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    for item in overrides:
        key, eq, value = item.partition("=")
        *parents, last = key.split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not eq or not isinstance(node, dict) or last not in node:
            raise ConfigError(f"{key}: {'expected key=value' if not eq else 'not a key of the run config'}")
        try:
            node[last] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{key}: {value!r} is not a YAML value") from None
    try:
        cfg = ExperimentConfig.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(f"{path}: {format_validation_error(e)}") from None
    # The run's own output folder (config.json may hold it relative to where the run started).
    cfg.output_dir = os.path.abspath(output_dir)
    cfg.model.path = last_checkpoint(output_dir)
    return cfg


def load(argv: list[str]):
    """(config, policy with .generate and .tokenizer, workflow episode, rows); ValueError for the
    user's mistakes."""
    if argv and "=" not in argv[0]:  # OUTPUT_DIR [key=value ...]
        cfg = run_config(argv[0], argv[1:])
    else:
        cfg = load_config(argv)  # ConfigError is a ValueError
    import_user_modules(cfg)
    try:
        episode, _ = workflow_of(cfg)
    except KeyError as e:
        raise ValueError(f"rollout.workflow: {e.args[0]}") from None
    except TypeError as e:  # workflow_kwargs the workflow does not take
        raise ValueError(f"rollout.workflow_kwargs of {cfg.rollout.workflow!r}: {e}") from None
    hf_logging.disable_progress_bar()
    cfg.model.path = prepare_model(cfg.model, cfg.seed)
    check_model_dir(cfg.model.path)
    tokenizer = load_tokenizer(cfg.model.path)
    resolve_chat_template(cfg, tokenizer)  # model.use_chat_template auto -> true/false, as the launcher decides it
    rows = eval_rows(cfg, tokenizer)
    # The built-in engine alone (no optimizer, no process group): what the generate MFC's
    # TorchEngine.generate runs, seeded as the actor's, its linears routed as the trainer's.
    model = load_model(cfg.model.path)
    use_onednn(model)
    policy = GenerationEngine(model, tokenizer, seed=cfg.seed)
    return cfg, policy, episode, rows


def run(cfg, policy, episode, rows, runner) -> dict[str, float]:
    """The eval metrics (realcore.workflows.evaluate), plus the reward calls that failed."""
    errors = {"reward/errors": 0, "reward/timeouts": 0}
    score = reward_fn(runner, errors)

    def make_engine(gconfig):  # one per pass: the pass's episodes decode together
        return BatchingEngine(policy, policy.tokenizer, gconfig, score, version=0)

    metrics = asyncio.run(evaluate(cfg, episode, make_engine, rows))
    return {**metrics, **{k: float(v) for k, v in errors.items()}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        print(f"realcore.eval: {bad[0]}: arguments are OUTPUT_DIR and/or key=value config overrides (see --help)", file=sys.stderr)
        return 2
    try:
        cfg, policy, episode, rows = load(argv)
        runner = reward_runner_for(cfg)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:  # config, model, dataset, workflow or reward: the user's to fix
        print(f"realcore.eval: error: {e}", file=sys.stderr)
        return 2
    source = eval_dataset(cfg)
    print(f"realcore.eval: {cfg.model.path} on {source.type} (seed {source.seed}), {len(rows)} prompts, "
          f"workflow {cfg.rollout.workflow}, reward {cfg.reward.type}", flush=True)
    try:  # a failure from here on is a bug, not bad input: its traceback, exit 1
        metrics = run(cfg, policy, episode, rows, runner)
    except KeyboardInterrupt:
        return 130
    finally:
        runner.close()
    print(_table(metrics))
    print(json.dumps(metrics), flush=True)
    if metrics["eval/failed"]:  # counted, not fatal; but a reader of the table must not miss it
        print(f"realcore.eval: {metrics['eval/failed']:.0f} of {2 * len(rows)} episodes failed and were scored 0 "
              "(the first are logged above)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
