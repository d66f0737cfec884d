"""Data as users have it: parquet files and HF `datasets` folders, key mapping (prompt key, chat
messages, answer key), a row's other fields handed to the reward and the workflow, and one-line
errors for a key that no row has."""

import json

import pytest
import torch

from realcore.api.config import DatasetConfig
from realcore.api.data import tensor_to_text
from realcore.api.workflow import workflow_data
from realcore.data.datasets import LoadedDataset, build_shard, load_hf, load_jsonl, load_parquet, load_tiny_arith
from test_datasets import tokenizer  # noqa: F401  (the fixture: a byte-level BPE with a chat template)

torch.set_num_threads(1)

ROWS = [{"problem": f"What is {i} + 1?", "solution": str(i + 1), "difficulty": i % 3, "tags": ["add", str(i)]}
        for i in range(10)]


def _load(fn, tok, rank=0, world=1, chat=False, **cfg) -> LoadedDataset:
    return fn(DatasetConfig(**cfg), tok, rank=rank, world=world, use_chat_template=chat)


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _write_hf(path, rows, splits=None):
    import datasets

    if splits is None:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    else:
        datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in splits.items()}).save_to_disk(str(path))
    return str(path)


def _rows(ds: LoadedDataset) -> list[dict]:
    return [workflow_data(s) for s in ds.samples]


MAPPED = dict(prompt_key="problem", answer_key="solution", prompt_template="{question}")


@pytest.mark.parametrize("kind", ["parquet", "hf", "jsonl"])
def test_a_mapped_file_gives_prompts_answers_and_fields(tokenizer, tmp_path, kind):  # noqa: F811
    if kind == "parquet":
        path, fn = _write_parquet(tmp_path / "d.parquet", ROWS), load_parquet
    elif kind == "hf":
        path, fn = _write_hf(tmp_path / "d", ROWS), load_hf
    else:
        path, fn = str(tmp_path / "d.jsonl"), load_jsonl
        (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ds = _load(fn, tokenizer, type=kind, path=path, **MAPPED)
    assert (ds.n_rows, ds.n_skipped) == (10, 0)
    for row, s, data in zip(ROWS, ds.samples, _rows(ds)):
        assert all(len(v) == 1 and v[0].dim() == 1 for v in s.values())  # every key: one 1-D tensor
        assert tokenizer.decode(s["prompt_ids"][0].tolist()) == row["problem"]
        # The workflow (and so the reward) gets the mapped question and answer and the other fields
        # by name, with their JSON types; the mapped keys are not passed twice.
        assert data["question"] == row["problem"] and data["answer"] == row["solution"]
        assert data["difficulty"] == row["difficulty"] and data["tags"] == row["tags"]
        assert "problem" not in data and "solution" not in data and "fields" not in data


def test_parquet_and_hf_shards_are_disjoint_and_cover(tokenizer, tmp_path):  # noqa: F811
    rows = [dict(r) for r in ROWS]
    rows[4]["solution"] = None  # a rare bad row: skipped and counted, and it still owns its index
    for fn, path, kind in [(load_parquet, _write_parquet(tmp_path / "d.parquet", rows), "parquet"),
                           (load_hf, _write_hf(tmp_path / "hf", rows), "hf")]:
        shards = [_load(fn, tokenizer, rank=r, world=3, type=kind, path=path, **MAPPED) for r in range(3)]
        answers = [[d["answer"] for d in _rows(s)] for s in shards]
        for r, a in enumerate(answers):
            assert all((int(x) - 1) % 3 == r for x in a), (kind, answers)
        assert sorted(int(x) for a in answers for x in a) == [i + 1 for i in range(10) if i != 4]
        assert [s.n_rows for s in shards] == [4, 3, 3]
        assert shards[1].skipped == {"missing field": 1}


def test_parquet_reader_shards_across_its_batches(tmp_path):
    from realcore.data.readers import parquet_rows

    path = _write_parquet(tmp_path / "big.parquet", [{"i": i} for i in range(2500)])  # 3 batches of rows
    cfg = DatasetConfig(type="parquet", path=path)
    for world in (1, 3):
        for rank in range(world):
            got = list(parquet_rows(cfg, rank, world))
            assert got == [(i, {"i": i}) for i in range(rank, 2500, world)]


def test_hf_dataset_dict_split(tokenizer, tmp_path):  # noqa: F811
    path = _write_hf(tmp_path / "dd", None, splits={"train": ROWS[:6], "test": ROWS[6:]})
    test = _load(load_hf, tokenizer, type="hf", path=path, split="test", **MAPPED)
    assert [d["answer"] for d in _rows(test)] == ["7", "8", "9", "10"]
    with pytest.raises(ValueError, match=r"^dataset\.split: .* holds the splits train, test: name one"):
        _load(load_hf, tokenizer, type="hf", path=path, **MAPPED)
    with pytest.raises(ValueError, match=r"^dataset\.split: no split 'dev'"):
        _load(load_hf, tokenizer, type="hf", path=path, split="dev", **MAPPED)
    one = _write_hf(tmp_path / "one", None, splits={"train": ROWS[:2]})
    assert len(_load(load_hf, tokenizer, type="hf", path=one, **MAPPED).samples) == 2


def test_bad_paths_are_one_line(tokenizer, tmp_path):  # noqa: F811
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"^dataset\.path: .*x\.parquet' is not a parquet file"):
        _load(load_parquet, tokenizer, type="parquet", path=str(tmp_path / "x.parquet"))
    with pytest.raises(ValueError, match=r"^dataset\.path: no such file"):
        _load(load_parquet, tokenizer, type="parquet", path=str(tmp_path / "nope.parquet"))
    with pytest.raises(ValueError, match=r"^dataset\.path: no such folder"):
        _load(load_hf, tokenizer, type="hf", path=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^dataset\.path: .* is not a folder written by datasets' save_to_disk"):
        _load(load_hf, tokenizer, type="hf", path=str(tmp_path / "empty"))


def test_a_key_no_row_has_is_one_error_naming_it(tokenizer, tmp_path):  # noqa: F811
    path = _write_parquet(tmp_path / "data.parquet", [{"question": "q", "solution": "1"}] * 5)
    with pytest.raises(ValueError) as e:
        _load(load_parquet, tokenizer, rank=1, world=2, type="parquet", path=path, prompt_key="problem",
              answer_key="solution")
    assert str(e.value) == (f"dataset: {path} row 1: no key 'problem' in any row (keys: question, solution); "
                            "set dataset.prompt_key")
    with pytest.raises(ValueError, match=r"^dataset: tiny-arith row 1: no key 'solution' in any row .*answer_key"):
        _load(load_tiny_arith, tokenizer, size=4, answer_key="solution")
    # jsonl: the shard holds no row with `answer`, but another shard's row has it: a rare bad row,
    # skipped and counted (the launcher then names the shard that has no usable row).
    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    shard = _load(load_jsonl, tokenizer, rank=1, world=2, type="jsonl", path=str(jl))
    assert (shard.n_rows, shard.skipped) == (1, {"missing field": 1})
    # A user's dataset that hands build_shard no way to read the whole source: its rows decide.
    rows = [(3, {"q": "a"}), (5, "bad json"), (7, {"q": "b", "answer": "1"})]
    assert build_shard(iter(rows[:2] + rows[2:]), DatasetConfig(prompt_key="q"), tokenizer, use_chat_template=False,
                       source="mine").skipped == {"missing field": 1, "bad json": 1}
    with pytest.raises(ValueError, match=r"^dataset: mine row 4: no key 'answer' in any row \(keys: q\)"):
        build_shard(iter(rows[:2]), DatasetConfig(prompt_key="q"), tokenizer, use_chat_template=False, source="mine")


def test_chat_messages_go_through_the_chat_template(tokenizer, tmp_path):  # noqa: F811
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
             "reward_model": {"ground_truth": "4", "style": "rule"}, "data_source": "arith"},
            {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reward_model": {"ground_truth": "2"}},
            {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "3"}}]  # no content: skipped
    path = _write_parquet(tmp_path / "verl.parquet", rows)
    # verl's layout: chat messages under `prompt`, the ground truth nested in `reward_model`.
    ds = _load(load_parquet, tokenizer, type="parquet", path=path, prompt_key="prompt",
               answer_key="reward_model.ground_truth", system_prompt="Think.")
    assert ds.skipped == {"bad messages": 1}
    first, second = (tokenizer.decode(s["prompt_ids"][0].tolist()) for s in ds.samples)
    assert first == "<system>Be brief.\n<user>What is 2 + 2?\n<assistant>"
    assert second == "<system>Think.\n<user>What is 1 + 1?\n<assistant>"  # system_prompt where none is given
    data = _rows(ds)
    assert [d["question"] for d in data] == ["What is 2 + 2?", "What is 1 + 1?"]
    assert [d["answer"] for d in data] == ["4", "2"]
    assert data[0]["data_source"] == "arith" and data[0]["reward_model"]["style"] == "rule"


def test_row_fields_reach_the_reward_arguments(tokenizer, tmp_path):  # noqa: F811
    """The built-in workflows pass every JSON field to the reward's `**data`; the reward MFC (which
    sees every key as text) unpacks `fields` the same way, never over a key it has."""
    from realcore.api.data import merge_row_fields
    from realcore.workflows.math import _row

    path = _write_parquet(tmp_path / "d.parquet", ROWS[:1])
    (s,) = _load(load_parquet, tokenizer, type="parquet", path=path, **MAPPED).samples
    data = {**workflow_data(s), "prompt": "p"}
    assert _row(data) == {"question": "What is 0 + 1?", "answer": "1", "difficulty": 0, "tags": ["add", "0"]}
    assert json.loads(tensor_to_text(s["fields"][0])) == {"difficulty": 0, "tags": ["add", "0"]}
    texts = {k: tensor_to_text(v[0]) for k, v in s.items() if k != "prompt_ids"}
    assert merge_row_fields({**texts, "fields": '{"answer": "no", "level": 2}'}) == {
        "question": "What is 0 + 1?", "answer": "1", "level": 2}
