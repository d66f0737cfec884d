"""Built-in datasets: files users bring (`jsonl`, `parquet`, `hf`: a `datasets` save_to_disk folder)
and generated ones (`reasoning-gym`, `tiny-arith`).

Every dataset is a function `fn(cfg, tokenizer, *, rank, world, use_chat_template) -> LoadedDataset`
that turns rows into samples (see realcore/api/data.py: every key holds a list of 1-D tensors, one
per sequence; a prompt is one sequence). A row's prompt is under `dataset.prompt_key` (text, or a
list of chat messages), its reference answer under `dataset.answer_key`; its other fields travel
as JSON text under the buffer key `fields` and reach the reward and the workflow by name.

Sharding: a data-parallel rank keeps the rows whose index satisfies `index % world == rank`, and
the index is taken *before* any row is skipped, so which rows a rank owns never depends on which
rows happen to be skipped (bad JSON, missing fields, long prompts). For jsonl the index counts
non-blank lines.

A row without the prompt or answer is skipped and counted; a key that no row of the source has is
a mapping mistake: a one-line error naming the key, the source and its first row.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from realcore.api.config import DatasetConfig
from realcore.api.data import ROW_FIELDS, Sample, chat_template_ids, text_to_tensor
from realcore.api.registry import register_dataset
from realcore.data.readers import Rows, hf_rows, jsonl_rows, parquet_rows


@dataclass
class LoadedDataset:
    """One rank's shard. `n_rows` counts the shard's rows before skipping; `skipped` maps reason -> count."""

    samples: list[Sample]
    n_rows: int
    n_skipped: int
    skipped: dict[str, int] = field(default_factory=dict)


SKIP_MISSING = "missing field"
SKIP_BAD_MESSAGES = "bad messages"
SKIP_TOO_LONG = "prompt too long"
SKIP_HELD_OUT = "held out for evaluation"

# Names the reward's signature and the sample already use: a row field of one of these names is not
# passed on (the mapped prompt and answer are `question` and `answer`).
RESERVED = frozenset({"prompt", "completion", "prompt_ids", "completion_ids", "question", "answer", ROW_FIELDS})


def held_out(question: str, fraction: float) -> bool:
    """Whether `dataset.holdout` keeps this question out of training: a hash of its text, so the
    split is the same in every process, run and seed."""
    h = int.from_bytes(hashlib.blake2b(question.encode(), digest_size=8).digest(), "big")
    return h < fraction * 2**64


def dataset_keys(cfg: DatasetConfig) -> tuple[str, ...]:
    """Buffer keys a built-in dataset's samples carry, by format."""
    return ("prompt_ids", "answer", "question", ROW_FIELDS) if cfg.format == "rl" else ("input_ids", "loss_mask")


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


MISSING = object()


def get_key(row: Mapping, key: str):
    """`row[key]`; a dotted key reaches into nested mappings (verl's `reward_model.ground_truth`)
    when the row has no key of that exact name. MISSING when absent."""
    if key in row:
        return row[key]
    v = row
    for part in key.split("."):
        if not isinstance(v, Mapping) or part not in v:
            return MISSING
        v = v[part]
    return v


def _text(v) -> str | None:
    """A non-empty text field; numbers (a jsonl `"answer": 72`) become text."""
    if v is None or v is MISSING or isinstance(v, (dict, list)):
        return None
    v = str(v)
    return v if v.strip() else None


def _messages(v) -> list[dict] | None:
    """Chat messages: a non-empty list of {role, content} with text in both; else None."""
    ok = isinstance(v, list) and v and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v)
    return [{"role": m["role"], "content": m["content"]} for m in v] if ok else None


def _question(v) -> tuple[str, list[dict] | None] | str:
    """(the bare question, the chat messages or None) of a prompt field, or why the row is skipped.
    The question of a conversation is its last user message."""
    if isinstance(v, list):
        messages = _messages(v)
        if messages is None:
            return SKIP_BAD_MESSAGES
        users = [m["content"] for m in messages if m["role"] == "user"]
        return (users[-1] if users else messages[-1]["content"]), messages
    question = _text(v)
    return SKIP_MISSING if question is None else (question, None)


def _prompt_ids(question: str, messages: list[dict] | None, cfg: DatasetConfig, tokenizer,
                use_chat_template: bool) -> list[int]:
    """Text goes through `prompt_template` (and the chat template if asked); chat messages
    through the chat template (`system_prompt` first unless they start with a system message)."""
    if messages is None:
        return prompt_token_ids(tokenizer, cfg.prompt_template.format(question=question), use_chat_template,
                                cfg.system_prompt)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"dataset.prompt_key: {cfg.prompt_key!r} holds chat messages, but the tokenizer has no "
                         "chat template to render them")
    if cfg.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    return chat_template_ids(tokenizer, messages)


def _other_fields(row: Mapping, cfg: DatasetConfig) -> dict:
    """The fields the reward and the workflow get by name besides `question` and `answer`."""
    return {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.answer_key) and k not in RESERVED}


def _row_to_sample(row: Mapping, cfg: DatasetConfig, tokenizer, use_chat_template: bool) -> Sample | str:
    """The sample of one row, or the reason it is skipped."""
    import torch  # the launcher imports this module (describe_skips) and starts without torch

    answer = _text(get_key(row, cfg.answer_key))
    got = _question(get_key(row, cfg.prompt_key))
    if answer is None or isinstance(got, str):
        return SKIP_MISSING if answer is None else got
    question, messages = got
    if cfg.holdout and held_out(question, cfg.holdout):
        return SKIP_HELD_OUT
    prompt = _prompt_ids(question, messages, cfg, tokenizer, use_chat_template)
    if len(prompt) > cfg.max_prompt_len:
        return SKIP_TOO_LONG
    if cfg.format == "rl":
        # JSON: a field may be a number, a list or a nested record (default=str: dates and the like
        # from parquet); one uint8 tensor like any text, so a sample stays 1-D tensors.
        fields = json.dumps(_other_fields(row, cfg), ensure_ascii=False, default=str)
        return {"prompt_ids": [torch.tensor(prompt, dtype=torch.int64)], "answer": [text_to_tensor(answer)],
                "question": [text_to_tensor(question)],  # the bare question: for chat-style (OpenAI API) agents
                ROW_FIELDS: [text_to_tensor(fields)]}
    # sft: the loss covers the answer and EOS. A plain prompt ends in "Answer:", so a space separates
    # the answer; after a chat template's generation prompt the answer starts directly.
    if tokenizer.eos_token_id is None:
        raise ValueError("dataset.format=sft: the tokenizer has no EOS token to end the answer with")
    text = answer if use_chat_template or messages is not None else " " + answer
    response = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
    mask = [0] * len(prompt) + [1] * len(response)
    return {
        "input_ids": [torch.tensor(prompt + response, dtype=torch.int64)],
        "loss_mask": [torch.tensor(mask, dtype=torch.int64)],
    }


def _absent_everywhere(all_rows: Callable[[], Rows], key: str) -> tuple[int, Mapping] | None:
    """(index, row) of the source's first row when no row has `key`; None when some row has it."""
    first = None
    for i, row in all_rows():
        if isinstance(row, str):
            continue
        if get_key(row, key) is not MISSING:
            return None
        if first is None:
            first = i, row
    return first


def build_shard(
    rows: Iterator[tuple[int, Mapping | str]],
    cfg: DatasetConfig,
    tokenizer,
    *,
    use_chat_template: bool,
    source: str,
    all_rows: Callable[[], Rows] | None = None,
) -> LoadedDataset:
    """Samples from this rank's `(index, row)` pairs (a row, or the reason it is already known to
    be skipped). `source` names the data in errors; `all_rows()` reads the whole source: when no
    row of the shard has the prompt or answer key, it tells a rare bad row (skipped and counted)
    from a mapping mistake (a one-line error). None: the shard's own rows decide."""
    samples, skipped, n_rows, n_read, first = [], Counter(), 0, 0, None
    absent = Counter()  # prompt_key / answer_key -> rows read without it
    for i, row in rows:
        n_rows += 1
        if isinstance(row, str):
            skipped[row] += 1
            continue
        n_read += 1
        first = first or (i, row)
        for name in ("prompt_key", "answer_key"):
            absent[name] += get_key(row, getattr(cfg, name)) is MISSING
        out = _row_to_sample(row, cfg, tokenizer, use_chat_template)
        if isinstance(out, str):
            skipped[out] += 1
        else:
            samples.append(out)
    for name in ("prompt_key", "answer_key"):
        key = getattr(cfg, name)
        if n_read and absent[name] == n_read and (
                missing := first if all_rows is None else _absent_everywhere(all_rows, key)) is not None:
            i, row = missing
            keys = ", ".join(sorted(map(str, row))) or "none"
            raise ValueError(f"dataset: {source} row {i + 1}: no key {key!r} in any row (keys: {keys}); "
                             f"set dataset.{name}")
    return LoadedDataset(samples, n_rows, sum(skipped.values()), dict(skipped))


def describe_skips(skipped: Mapping[str, int]) -> str:
    """'bad json 5, missing field 3' (largest first), or 'none'."""
    return ", ".join(f"{why} {n}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])) or "none"


def _check_shard(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"dataset shard: rank {rank} is not in [0, world={world})")


# ----------------------------------------------------------------------------------------------
# The built-in datasets


def _load_file(read: Callable[[DatasetConfig, int, int], Rows], cfg: DatasetConfig, tokenizer, rank: int, world: int,
               use_chat_template: bool) -> LoadedDataset:
    _check_shard(rank, world)
    return build_shard(read(cfg, rank, world), cfg, tokenizer, use_chat_template=use_chat_template, source=cfg.path,
                       all_rows=lambda: read(cfg, 0, 1))


@register_dataset("jsonl", keys=dataset_keys)
def load_jsonl(cfg: DatasetConfig, tokenizer, *, rank: int, world: int, use_chat_template: bool) -> LoadedDataset:
    """A jsonl file of one JSON object per line (GSM8K's format: `{"question": ..., "answer": ...}`)."""
    return _load_file(jsonl_rows, cfg, tokenizer, rank, world, use_chat_template)


@register_dataset("parquet", keys=dataset_keys)
def load_parquet(cfg: DatasetConfig, tokenizer, *, rank: int, world: int, use_chat_template: bool) -> LoadedDataset:
    """A parquet file (verl's format: its columns are the row's keys)."""
    return _load_file(parquet_rows, cfg, tokenizer, rank, world, use_chat_template)


@register_dataset("hf", keys=dataset_keys)
def load_hf(cfg: DatasetConfig, tokenizer, *, rank: int, world: int, use_chat_template: bool) -> LoadedDataset:
    """A local folder written by HF datasets' `save_to_disk` (`dataset.split` for a DatasetDict)."""
    return _load_file(hf_rows, cfg, tokenizer, rank, world, use_chat_template)


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
    def rows(rank: int, world: int) -> Rows:
        return ((i, ds[i]) for i in range(rank, cfg.size, world))

    return build_shard(rows(rank, world), cfg, tokenizer, use_chat_template=use_chat_template,
                       source=f"reasoning-gym {cfg.task}", all_rows=lambda: rows(0, 1))


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
    rows = list(enumerate(tiny_arith_rows(cfg.seed, cfg.size)))
    return build_shard((r for r in rows if r[0] % world == rank), cfg, tokenizer, use_chat_template=use_chat_template,
                       source="tiny-arith", all_rows=lambda: iter(rows))
