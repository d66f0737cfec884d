"""Built-in datasets: `jsonl` (GSM8K format), `reasoning-gym` and `tiny-arith`.

Every dataset is a function `fn(cfg, tokenizer, *, rank, world, use_chat_template) -> LoadedDataset`
that turns rows `{"question", "answer"}` into samples (see realcore/api/data.py: every key holds a
list of 1-D tensors, one per sequence; a prompt is one sequence).

Sharding: a data-parallel rank keeps the rows whose index satisfies `index % world == rank`, and
the index is taken *before* any row is skipped, so which rows a rank owns never depends on which
rows happen to be skipped (bad JSON, missing fields, long prompts). For jsonl the index counts
non-blank lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from realcore.api.config import DatasetConfig
from realcore.api.data import Sample, chat_template_ids, text_to_tensor
from realcore.api.registry import register_dataset


@dataclass
class LoadedDataset:
    """One rank's shard. `n_rows` counts the shard's rows before skipping; `skipped` maps reason -> count."""

    samples: list[Sample]
    n_rows: int
    n_skipped: int
    skipped: dict[str, int] = field(default_factory=dict)


SKIP_BAD_JSON = "bad json"
SKIP_MISSING = "missing field"
SKIP_TOO_LONG = "prompt too long"
SKIP_HELD_OUT = "held out for evaluation"


def held_out(question: str, fraction: float) -> bool:
    """Whether `dataset.holdout` keeps this question out of training: a hash of its text, so the
    split is the same in every process, run and seed."""
    h = int.from_bytes(hashlib.blake2b(question.encode(), digest_size=8).digest(), "big")
    return h < fraction * 2**64


def dataset_keys(cfg: DatasetConfig) -> tuple[str, ...]:
    """Buffer keys a built-in dataset's samples carry, by format."""
    return ("prompt_ids", "answer", "question") if cfg.format == "rl" else ("input_ids", "loss_mask")


# ----------------------------------------------------------------------------------------------
# Row -> sample


def prompt_token_ids(tokenizer, prompt: str, use_chat_template: bool, system_prompt: str | None = None) -> list[int]:
    """Token ids of a prompt, through the chat template (with the generation prompt) if asked;
    `system_prompt` replaces the template's default system message."""
    if not use_chat_template:
        # add_special_tokens: a BOS where the model family expects one (Llama), nothing for Qwen.
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return chat_template_ids(tokenizer, messages)


def _field(row: Mapping, key: str) -> str | None:
    """A non-empty text field; numbers (a jsonl `"answer": 72`) become text."""
    v = row.get(key)
    if v is None or isinstance(v, (dict, list)):
        return None
    v = str(v)
    return v if v.strip() else None


def _row_to_sample(row: Mapping, cfg: DatasetConfig, tokenizer, use_chat_template: bool) -> Sample | str:
    """The sample of one row, or the reason it is skipped."""
    import torch  # the launcher imports this module (describe_skips) and starts without torch

    question, answer = _field(row, "question"), _field(row, "answer")
    if question is None or answer is None:
        return SKIP_MISSING
    if cfg.holdout and held_out(question, cfg.holdout):
        return SKIP_HELD_OUT
    prompt = prompt_token_ids(tokenizer, cfg.prompt_template.format(question=question), use_chat_template, cfg.system_prompt)
    if len(prompt) > cfg.max_prompt_len:
        return SKIP_TOO_LONG
    if cfg.format == "rl":
        return {"prompt_ids": [torch.tensor(prompt, dtype=torch.int64)], "answer": [text_to_tensor(answer)],
                "question": [text_to_tensor(question)]}  # the bare question: for chat-style (OpenAI API) agents
    # sft: the loss covers the answer and EOS. A plain prompt ends in "Answer:", so a space separates
    # the answer; after a chat template's generation prompt the answer starts directly.
    if tokenizer.eos_token_id is None:
        raise ValueError("dataset.format=sft: the tokenizer has no EOS token to end the answer with")
    text = answer if use_chat_template else " " + answer
    response = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
    mask = [0] * len(prompt) + [1] * len(response)
    return {
        "input_ids": [torch.tensor(prompt + response, dtype=torch.int64)],
        "loss_mask": [torch.tensor(mask, dtype=torch.int64)],
    }


def build_shard(
    rows: Iterator[Mapping | str],
    cfg: DatasetConfig,
    tokenizer,
    *,
    use_chat_template: bool,
) -> LoadedDataset:
    """Samples from this rank's rows (a row, or the reason it is already known to be skipped)."""
    samples, skipped, n_rows = [], Counter(), 0
    for row in rows:
        n_rows += 1
        out = row if isinstance(row, str) else _row_to_sample(row, cfg, tokenizer, use_chat_template)
        if isinstance(out, str):
            skipped[out] += 1
        else:
            samples.append(out)
    return LoadedDataset(samples, n_rows, sum(skipped.values()), dict(skipped))


def describe_skips(skipped: Mapping[str, int]) -> str:
    """'bad json 5, missing field 3' (largest first), or 'none'."""
    return ", ".join(f"{why} {n}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])) or "none"


def _check_shard(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"dataset shard: rank {rank} is not in [0, world={world})")


# ----------------------------------------------------------------------------------------------
# The built-in datasets


def _jsonl_rows(path: str, rank: int, world: int) -> Iterator[Mapping | str]:
    """This rank's rows of a jsonl file; only the owned lines are parsed."""
    with open(path, "rb") as f:  # bytes: a line with invalid UTF-8 is one bad row, not a crash
        lines = (line for line in f if line.strip())
        for i, line in enumerate(lines):
            if i % world != rank:
                continue
            try:
                row = json.loads(line)
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                yield SKIP_BAD_JSON
                continue
            yield row if isinstance(row, dict) else SKIP_BAD_JSON


@register_dataset("jsonl", keys=dataset_keys)
def load_jsonl(cfg: DatasetConfig, tokenizer, *, rank: int, world: int, use_chat_template: bool) -> LoadedDataset:
    """A jsonl file of `{"question": ..., "answer": ...}` rows (GSM8K's format)."""
    _check_shard(rank, world)
    if cfg.path is None:
        raise ValueError("dataset.path: required for dataset.type=jsonl")
    path = os.path.expanduser(cfg.path)
    if not os.path.isfile(path):
        raise ValueError(f"dataset.path: no such file {cfg.path!r}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"dataset.path: cannot read {cfg.path!r} (permission denied)")
    return build_shard(_jsonl_rows(path, rank, world), cfg, tokenizer, use_chat_template=use_chat_template)


@register_dataset("reasoning-gym", keys=dataset_keys)
def load_reasoning_gym(
    cfg: DatasetConfig, tokenizer, *, rank: int, world: int, use_chat_template: bool
) -> LoadedDataset:
    """`cfg.size` problems of a reasoning-gym task; item i depends only on (task, seed, i)."""
    _check_shard(rank, world)
    import reasoning_gym  # heavy import, only for this dataset

    try:
        ds = reasoning_gym.create_dataset(cfg.task, size=cfg.size, seed=cfg.seed, **cfg.task_kwargs)
    except Exception as e:
        raise ValueError(f"dataset.task={cfg.task!r}: reasoning_gym cannot create it: {e}") from None
    # Items are generated on access, so a rank only generates its own shard.
    rows = (ds[i] for i in range(rank, cfg.size, world))
    return build_shard(rows, cfg, tokenizer, use_chat_template=use_chat_template)


def tiny_arith_rows(seed: int, size: int) -> list[dict[str, str]]:
    """`size` problems "What is a + b?" / "What is a - b?" with operands in [0, 20] and a >= b for
    subtraction (answers are never negative: easy enough for a tiny model to learn on CPU)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        if rng.random() < 0.5:
            rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
        else:
            a, b = max(a, b), min(a, b)
            rows.append({"question": f"What is {a} - {b}?", "answer": str(a - b)})
    return rows


@register_dataset("tiny-arith", keys=dataset_keys)
def load_tiny_arith(cfg: DatasetConfig, tokenizer, *, rank: int, world: int, use_chat_template: bool) -> LoadedDataset:
    """Built-in addition/subtraction problems seeded by `cfg.seed` (tests and tiny runs)."""
    _check_shard(rank, world)
    rows = tiny_arith_rows(cfg.seed, cfg.size)
    shard = (r for i, r in enumerate(rows) if i % world == rank)
    return build_shard(shard, cfg, tokenizer, use_chat_template=use_chat_template)
