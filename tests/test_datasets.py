"""Built-in datasets: row -> sample formats, skipping and counting, sharding, determinism."""

import json

import pytest
import torch

from realcore.api.config import DatasetConfig
from realcore.api.data import tensor_to_text
from realcore.api.registry import dataset_keys, lookup
from realcore.data.datasets import LoadedDataset, load_jsonl, load_reasoning_gym, load_tiny_arith
from realcore.data.datasets import dataset_keys as dataset_keys_of_builtins

torch.set_num_threads(1)

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained in a second on a tiny corpus, wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([f"Question: What is {a} + {a + 3}?\nAnswer: {2 * a + 3}" for a in range(50)], trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    out.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return out


def _load(fn, tokenizer, rank=0, world=1, chat=False, **cfg) -> LoadedDataset:
    return fn(DatasetConfig(**cfg), tokenizer, rank=rank, world=world, use_chat_template=chat)


def _answers(ds: LoadedDataset) -> list[str]:
    return [tensor_to_text(s["answer"][0]) for s in ds.samples]


def _write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_tiny_arith_rl(tokenizer):
    ds = _load(load_tiny_arith, tokenizer, size=20, seed=3)
    assert (ds.n_rows, ds.n_skipped, len(ds.samples)) == (20, 0, 20)
    for s in ds.samples:
        assert set(s) == {"prompt_ids", "answer", "question", "fields"}
        assert tensor_to_text(s["fields"][0]) == "{}"
        (ids,) = s["prompt_ids"]
        assert ids.dtype == torch.int64 and ids.dim() == 1
        prompt = tokenizer.decode(ids.tolist())
        a, op, b = prompt.split("What is ")[1].rstrip("?\nAnswer:").split()
        assert int(tensor_to_text(s["answer"][0])) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert prompt.startswith("Question: What is ") and prompt.endswith("?\nAnswer:")
    again = _load(load_tiny_arith, tokenizer, size=20, seed=3)
    other = _load(load_tiny_arith, tokenizer, size=20, seed=4)
    assert all(torch.equal(x["prompt_ids"][0], y["prompt_ids"][0]) for x, y in zip(ds.samples, again.samples))
    assert [tokenizer.decode(s["prompt_ids"][0]) for s in ds.samples] != [
        tokenizer.decode(s["prompt_ids"][0]) for s in other.samples
    ]


def test_chat_template_gives_plain_int_ids(tokenizer):
    ds = _load(load_tiny_arith, tokenizer, chat=True, size=2)
    ids = ds.samples[0]["prompt_ids"][0]
    assert ids.dtype == torch.int64 and ids.dim() == 1
    text = tokenizer.decode(ids.tolist())
    assert text.startswith("<user>Question: What is ") and text.endswith("\n<assistant>")


@pytest.mark.parametrize("chat", [False, True])
def test_sft_masks(tokenizer, chat):
    rl = _load(load_tiny_arith, tokenizer, chat=chat, size=5)
    sft = _load(load_tiny_arith, tokenizer, chat=chat, size=5, format="sft")
    for r, s in zip(rl.samples, sft.samples):
        assert set(s) == {"input_ids", "loss_mask"}
        ids, mask = s["input_ids"][0], s["loss_mask"][0]
        prompt = r["prompt_ids"][0]
        assert ids.shape == mask.shape and ids.dtype == mask.dtype == torch.int64
        assert torch.equal(ids[: len(prompt)], prompt)
        assert mask[: len(prompt)].sum() == 0 and bool(mask[len(prompt) :].all())
        sep = "" if chat else " "
        assert tokenizer.decode(ids[mask == 1].tolist()) == sep + tensor_to_text(r["answer"][0]) + EOS


def test_jsonl_skips_and_counts(tokenizer, tmp_path):
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"question": "What is 1 + 2?", "answer": "1 + 2 = 3\n#### 3"},
            {"question": "What is 2 + 2?", "answer": 4},  # a number is text "4"
            {"answer": "5"},
            {"question": "q", "answer": "  "},
            {"question": None, "answer": "1"},
            "{not json",
            "[1, 2]",
            "",  # blank lines are not rows
            {"question": "What is " + "1 + " * 200 + "1?", "answer": "201"},
        ],
    )
    (tmp_path / "bytes.jsonl").write_bytes(b'{"question": "\xff", "answer": "1"}\n')
    ds = _load(load_jsonl, tokenizer, type="jsonl", path=path, max_prompt_len=64)
    assert _answers(ds) == ["1 + 2 = 3\n#### 3", "4"]
    assert ds.skipped == {"missing field": 3, "bad json": 2, "prompt too long": 1}
    assert (ds.n_rows, ds.n_skipped) == (8, 6)
    bad = _load(load_jsonl, tokenizer, type="jsonl", path=str(tmp_path / "bytes.jsonl"))
    assert (bad.n_rows, bad.skipped) == (1, {"bad json": 1})


def test_jsonl_missing_file(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"^dataset\.path: no such file"):
        _load(load_jsonl, tokenizer, type="jsonl", path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match=r"^dataset\.path"):
        _load(load_jsonl, tokenizer, type="jsonl")


def test_jsonl_shards_are_disjoint_and_cover(tokenizer, tmp_path):
    rows = [{"question": f"What is {i} + 0?", "answer": str(i)} for i in range(23)]
    rows[4] = "{bad"
    rows[9] = {"question": "q"}
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    world = 3
    shards = [_load(load_jsonl, tokenizer, rank=r, world=world, type="jsonl", path=path) for r in range(world)]
    seen = [set(_answers(s)) for s in shards]
    assert sum(len(s) for s in seen) == len(set().union(*seen)) == 21
    assert set().union(*seen) == {str(i) for i in range(23)} - {"4", "9"}
    # The row index is taken before skipping: row i belongs to rank i % world whatever was skipped.
    for r, s in enumerate(seen):
        assert all(int(a) % world == r for a in s)
    assert [s.n_rows for s in shards] == [8, 8, 7]
    assert shards[1].skipped == {"bad json": 1} and shards[0].skipped == {"missing field": 1}
    with pytest.raises(ValueError, match="rank 3"):
        _load(load_jsonl, tokenizer, rank=3, world=3, type="jsonl", path=path)


def test_reasoning_gym_deterministic_and_sharded(tokenizer):
    cfg = dict(type="reasoning-gym", task="basic_arithmetic", size=12, seed=5)
    full = _load(load_reasoning_gym, tokenizer, **cfg)
    again = _load(load_reasoning_gym, tokenizer, **cfg)
    other = _load(load_reasoning_gym, tokenizer, **{**cfg, "seed": 6})
    prompts = lambda ds: [tokenizer.decode(s["prompt_ids"][0]) for s in ds.samples]  # noqa: E731
    assert len(full.samples) == 12 and prompts(full) == prompts(again) and _answers(full) == _answers(again)
    assert prompts(full) != prompts(other)
    shards = [_load(load_reasoning_gym, tokenizer, rank=r, world=2, **cfg) for r in range(2)]
    assert prompts(shards[0]) == prompts(full)[0::2] and prompts(shards[1]) == prompts(full)[1::2]
    with pytest.raises(ValueError, match="dataset.task='no-such-task'"):
        _load(load_reasoning_gym, tokenizer, **{**cfg, "task": "no-such-task"})


def test_registered_with_keys():
    import realcore.data  # noqa: F401

    assert lookup("dataset", "jsonl") is load_jsonl
    assert lookup("dataset", "tiny-arith") is load_tiny_arith
    assert lookup("dataset", "reasoning-gym") is load_reasoning_gym
    assert dataset_keys(DatasetConfig()) == ("prompt_ids", "answer", "question", "fields")
    assert lookup("dataset", "parquet").dataset_keys is dataset_keys_of_builtins
    assert lookup("dataset", "hf").dataset_keys is dataset_keys_of_builtins
    assert dataset_keys(DatasetConfig(type="jsonl", format="sft")) == ("input_ids", "loss_mask")
