"""Preference pairs for reward models: `preference-jsonl` and the built-in `arith-preference`.

A sample is one pair, two sequences, chosen first: `input_ids` = [prompt + chosen + EOS,
prompt + rejected + EOS] and `loss_mask` = 1 on each response (see realcore/api/data.py). A
pair's sequences travel as one sample, so the engines keep them in one micro-batch
(`group_sizes`) and a Bradley-Terry loss sees both (realcore/mfc/reward_model.py).

The prompt is `dataset.prompt_template` with `{question}` = the row's `prompt`, tokenized as the
RL datasets tokenize theirs (chat template or not) and a response as the SFT format does: a reward
model trained here scores the sequences an RL run with the same template generates.

The held-out split (`dataset.holdout`) is by a hash of the prompt text, as for the other datasets
(`datasets.held_out`): training loads the pairs outside it, `load_heldout_pairs` the pairs inside.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Mapping
from typing import Literal

from realcore.api.config import DatasetConfig
from realcore.api.data import Sample
from realcore.api.registry import register_dataset
from realcore.data.datasets import (SKIP_HELD_OUT, SKIP_TOO_LONG, LoadedDataset, _check_shard, held_out,
                                    prompt_token_ids)

PREFERENCE_KEYS = ("input_ids", "loss_mask")
Split = Literal["train", "heldout"]


def pair_sample(prompt: str, chosen: str, rejected: str, cfg: DatasetConfig, tokenizer, *,
                use_chat_template: bool) -> Sample | str:
    """The sample of one pair (chosen first), or why it is skipped (its prompt is too long)."""
    import torch  # the launcher imports the data package (dataset keys) and starts without torch

    ids = prompt_token_ids(tokenizer, cfg.prompt_template.format(question=prompt), use_chat_template,
                           cfg.system_prompt)
    if len(ids) > cfg.max_prompt_len:
        return SKIP_TOO_LONG
    if tokenizer.eos_token_id is None:
        raise ValueError("preference datasets: the tokenizer has no EOS token to end a response with")
    sample: Sample = {"input_ids": [], "loss_mask": []}
    for text in (chosen, rejected):
        # As the SFT format: after a plain "Answer:" a space separates the response.
        response = list(tokenizer.encode(text if use_chat_template else " " + text, add_special_tokens=False))
        response.append(tokenizer.eos_token_id)
        sample["input_ids"].append(torch.tensor(ids + response, dtype=torch.int64))
        sample["loss_mask"].append(torch.tensor([0] * len(ids) + [1] * len(response), dtype=torch.int64))
    return sample


def _in_split(prompt: str, cfg: DatasetConfig, split: Split) -> bool:
    if split == "heldout":
        return bool(cfg.holdout) and held_out(prompt, cfg.holdout)
    return not (cfg.holdout and held_out(prompt, cfg.holdout))


def build_pairs(rows: Iterator[tuple[str, str, str]], cfg: DatasetConfig, tokenizer, *, split: Split,
                use_chat_template: bool) -> LoadedDataset:
    """Samples of the (prompt, chosen, rejected) rows in `split`; the others are counted as skipped."""
    samples, skipped, n_rows = [], {}, 0
    for prompt, chosen, rejected in rows:
        n_rows += 1
        out = pair_sample(prompt, chosen, rejected, cfg, tokenizer, use_chat_template=use_chat_template) \
            if _in_split(prompt, cfg, split) else SKIP_HELD_OUT if split == "train" else "not held out"
        if isinstance(out, str):
            skipped[out] = skipped.get(out, 0) + 1
        else:
            samples.append(out)
    return LoadedDataset(samples, n_rows, sum(skipped.values()), skipped)


# ----------------------------------------------------------------------------------------------
# preference-jsonl


def _text(row: Mapping, key: str, path: str, line_no: int) -> str:
    v = row.get(key)
    if not isinstance(v, (str, int, float)) or isinstance(v, bool) or not str(v).strip():
        raise ValueError(f"dataset.path {path!r} line {line_no}: field {key!r} must be non-empty text, got {v!r}")
    return str(v)


def jsonl_pairs(path: str, rank: int, world: int) -> Iterator[tuple[str, str, str]]:
    """This rank's (prompt, chosen, rejected) rows (every `world`-th non-blank line from `rank`).
    A bad row is an error naming its line: a preference file is curated data, and a pair silently
    dropped (or a chosen/rejected swapped by a typo) would train the model on something else."""
    with open(path, "rb") as f:
        n = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            n += 1
            if (n - 1) % world != rank:
                continue
            try:
                row = json.loads(line)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"dataset.path {path!r} line {line_no}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"dataset.path {path!r} line {line_no}: a row must be an object with prompt, "
                                 f"chosen and rejected, got {type(row).__name__}")
            prompt, chosen, rejected = (_text(row, k, path, line_no) for k in ("prompt", "chosen", "rejected"))
            if chosen == rejected:
                raise ValueError(f"dataset.path {path!r} line {line_no}: chosen and rejected are the same text")
            yield prompt, chosen, rejected


def _jsonl_path(cfg: DatasetConfig) -> str:
    if cfg.path is None:
        raise ValueError("dataset.path: required for dataset.type=preference-jsonl")
    path = os.path.expanduser(cfg.path)
    if not os.path.isfile(path):
        raise ValueError(f"dataset.path: no such file {cfg.path!r}")
    return path


@register_dataset("preference-jsonl", keys=PREFERENCE_KEYS)
def load_preference_jsonl(cfg: DatasetConfig, tokenizer, *, rank: int, world: int,
                          use_chat_template: bool) -> LoadedDataset:
    """A jsonl file of `{"prompt": ..., "chosen": ..., "rejected": ...}` rows."""
    _check_shard(rank, world)
    return build_pairs(jsonl_pairs(_jsonl_path(cfg), rank, world), cfg, tokenizer, split="train",
                       use_chat_template=use_chat_template)


# ----------------------------------------------------------------------------------------------
# arith-preference


MIN_GAP = 8  # a rejected answer is at least this far from the correct one


def _arith_question(rng: random.Random, op: str) -> tuple[str, int]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    if op == "+":
        return f"What is {a} + {b}?", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b


def arith_preference_rows(seed: int, size: int) -> list[tuple[str, str, str]]:
    """`size` pairs: "What is a + b?" (or a - b, a >= b) with operands in [0, 20], the correct
    answer chosen and a wrong one rejected. The wrong answer is the correct answer of another
    question of the same operation (at least MIN_GAP away): chosen and rejected answers are then
    drawn from one distribution, so no rule that ignores the question (e.g. "the smaller number
    wins": 68% right with a wrong answer of correct +- 5..15, 56% here) does much better than
    chance: ranking them takes the sum."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        op = "+" if rng.random() < 0.5 else "-"
        question, answer = _arith_question(rng, op)
        wrong = answer
        while abs(wrong - answer) < MIN_GAP:
            wrong = _arith_question(rng, op)[1]
        rows.append((question, str(answer), str(wrong)))
    return rows


@register_dataset("arith-preference", keys=PREFERENCE_KEYS)
def load_arith_preference(cfg: DatasetConfig, tokenizer, *, rank: int, world: int,
                          use_chat_template: bool) -> LoadedDataset:
    """Built-in pairs (correct over wrong arithmetic answers) seeded by `cfg.seed`, `cfg.size` rows."""
    _check_shard(rank, world)
    rows = (r for i, r in enumerate(arith_preference_rows(cfg.seed, cfg.size)) if i % world == rank)
    return build_pairs(rows, cfg, tokenizer, split="train", use_chat_template=use_chat_template)


def load_heldout_pairs(cfg: DatasetConfig, tokenizer, *, use_chat_template: bool, n: int) -> list[Sample]:
    """Up to `n` pairs of the held-out split (prompts that `dataset.holdout` keeps out of training),
    distinct prompts: a reward model's evaluation set."""
    if not cfg.holdout:
        raise ValueError("dataset.holdout: 0 leaves no held-out pairs to evaluate a reward model on")
    if cfg.type == "arith-preference":
        rows = iter(arith_preference_rows(cfg.seed, cfg.size))
    elif cfg.type == "preference-jsonl":
        rows = jsonl_pairs(_jsonl_path(cfg), 0, 1)
    else:
        raise ValueError(f"dataset.type: held-out preference pairs come from arith-preference or "
                         f"preference-jsonl, not {cfg.type!r}")
    seen: set[str] = set()
    distinct = ((p, c, r) for p, c, r in rows if not (p in seen or seen.add(p)))
    pairs = build_pairs(distinct, cfg, tokenizer, split="heldout", use_chat_template=use_chat_template).samples
    return pairs[:n]
