"""Reward models: the Bradley-Terry loss against its formula, the preference datasets (rows, jsonl
errors, held-out split), rm_train / rm_inf on a stand-in engine, and the reward combiner.

`ScoreEngine` below stands in for an engine's score head only (the `scores()` inference and a
`train_batch` that micro-batches like the real engines, keeping groups whole, and hands the loss a
HeadOutput with `scores`); the real engines' score heads are tested in tests/test_heads.py and the
whole run in tests/test_e2e_reward_model.py."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from realcore.api.config import DatasetConfig, MFCConfig
from realcore.api.data import SequenceSample
from realcore.api.engine import HeadOutput
from realcore.api.registry import dataset_keys, lookup, mfc_spec
from realcore.backends.batching import cu_seqlens, split_by_budget
from realcore.backends.models import build_tiny_tokenizer
from realcore.data.datasets import held_out
from realcore.data.preferences import (MIN_GAP, arith_preference_rows, load_arith_preference, load_heldout_pairs,
                                       load_preference_jsonl)
from realcore.mfc.reward_model import CombineRewards, RMInference, RMTrain, bradley_terry_loss, n_pairs, pair_loss

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(512)


def _ds(**kw) -> DatasetConfig:
    return DatasetConfig(**kw)


# ----------------------------------------------------------------------------------------------
# The loss


def test_bradley_terry_loss_is_the_formula():
    sc = [2.0, -1.0, 0.5, 3.0]
    sr = [1.0, 0.5, 0.5, -4.0]
    # -log sigmoid(d) = log(1 + exp(-d)), mean over pairs (InstructGPT eq. 1)
    expected = sum(math.log(1 + math.exp(-(c - r))) for c, r in zip(sc, sr)) / 4
    loss, stats = bradley_terry_loss(torch.tensor(sc), torch.tensor(sr))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["rm/accuracy"].item() == pytest.approx(2 / 4)  # the tie (0.5, 0.5) counts as wrong
    assert stats["rm/margin"].item() == pytest.approx(sum(c - r for c, r in zip(sc, sr)) / 4)
    # its gradient: d/ds_c = -(1 - sigmoid(d)) / n
    c = torch.tensor(sc, requires_grad=True)
    bradley_terry_loss(c, torch.tensor(sr))[0].backward()
    want = [-(1 - 1 / (1 + math.exp(-(a - b)))) / 4 for a, b in zip(sc, sr)]
    assert c.grad.tolist() == pytest.approx(want, rel=1e-5)
    # a huge negative margin stays finite (logsigmoid, not log(sigmoid))
    big, _ = bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0]))
    assert big.item() == pytest.approx(400.0)


def test_pair_loss_reads_pairs_from_the_head_output():
    lens = [3, 4, 2, 5]  # chosen, rejected, chosen, rejected
    data = {"pair_side": torch.cat([torch.tensor([s] + [0.0] * (n - 1)) for s, n in zip([1, -1, 1, -1], lens)])}
    scores = torch.tensor([1.0, 3.0, 2.0, -2.0])
    loss, stats = pair_loss(HeadOutput(cu_seqlens(lens), scores=scores), data)
    expected = (math.log(1 + math.exp(-(1 - 3))) + math.log(1 + math.exp(-(2 + 2)))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["rm/accuracy"].item() == 0.5 and n_pairs(data) == 2
    with pytest.raises(AssertionError, match="whole pairs"):  # a pair cut by a micro-batch boundary
        pair_loss(HeadOutput(cu_seqlens(lens[1:]), scores=scores[1:]), {"pair_side": data["pair_side"][3:]})
    with pytest.raises(ValueError, match="head: score"):
        pair_loss(HeadOutput(cu_seqlens(lens), logprobs=torch.zeros(14)), data)


# ----------------------------------------------------------------------------------------------
# The datasets


def _decode(tok, ids, mask=None):
    return tok.decode((ids if mask is None else ids[mask.bool()]).tolist())


def test_arith_preference_pairs(tok):
    ds = load_arith_preference(_ds(type="arith-preference", size=40, seed=3), tok, rank=0, world=1,
                               use_chat_template=False)
    assert len(ds.samples) == 40 and dataset_keys(_ds(type="arith-preference")) == ("input_ids", "loss_mask")
    for s in ds.samples:
        (c, r), (mc, mr) = s["input_ids"], s["loss_mask"]
        prompt = _decode(tok, c[mc == 0])
        a, op, b = prompt.removeprefix("Question: What is ").removesuffix("?\nAnswer:").split()
        truth = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert _decode(tok, c, mc) == f" {truth}<|endoftext|>"  # chosen (first): the correct answer
        wrong = int(_decode(tok, r, mr).removesuffix("<|endoftext|>"))
        assert abs(wrong - truth) >= MIN_GAP and 0 <= wrong <= (40 if op == "+" else 20)
        assert _decode(tok, r[mr == 0]) == prompt
    again = load_arith_preference(_ds(type="arith-preference", size=40, seed=3), tok, rank=0, world=1,
                                  use_chat_template=False)
    assert all(torch.equal(x, y) for s, t in zip(ds.samples, again.samples) for x, y in zip(s["input_ids"], t["input_ids"]))


def test_arith_preference_needs_the_question():
    """Chosen and rejected answers come from one distribution: a rule that reads only the two
    numbers (the smaller wins, the larger wins) stays near chance, so ranking them takes the sum."""
    rows = arith_preference_rows(1, 4000)
    smaller = sum(int(c) < int(r) for _, c, r in rows) / len(rows)
    assert 0.4 < smaller < 0.6


def _prompts(tok, samples):
    return {_decode(tok, s["input_ids"][0][s["loss_mask"][0] == 0]) for s in samples}


def test_held_out_split_is_disjoint_and_by_question_hash(tok):
    cfg = _ds(type="arith-preference", size=600, seed=1, holdout=0.3)
    train = load_arith_preference(cfg, tok, rank=0, world=1, use_chat_template=False)
    held = load_heldout_pairs(cfg, tok, use_chat_template=False, n=1000)
    assert train.skipped.get("held out for evaluation", 0) > 0 and len(held) > 20
    tp, hp = _prompts(tok, train.samples), _prompts(tok, held)
    assert not tp & hp and len(hp) == len(held)  # disjoint, distinct prompts
    questions = {q for q, _, _ in arith_preference_rows(1, 600)}
    assert {f"Question: {q}\nAnswer:" for q in questions if held_out(q, 0.3)} == hp
    assert len(load_heldout_pairs(cfg, tok, use_chat_template=False, n=5)) == 5
    with pytest.raises(ValueError, match="dataset.holdout"):
        load_heldout_pairs(_ds(type="arith-preference"), tok, use_chat_template=False, n=5)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_preference_jsonl(tok, tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
    path = _write(tmp_path / "p.jsonl", rows[:3] + [""] + rows[3:])  # a blank line is no row
    ds = load_preference_jsonl(_ds(type="preference-jsonl", path=path, prompt_template="{question}"), tok,
                               rank=0, world=1, use_chat_template=False)
    assert [_decode(tok, s["input_ids"][0]) for s in ds.samples] == [f"q{i} good {i}<|endoftext|>" for i in range(6)]
    assert [_decode(tok, s["input_ids"][1], s["loss_mask"][1]) for s in ds.samples] == [
        f" bad {i}<|endoftext|>" for i in range(6)]
    shards = [load_preference_jsonl(_ds(type="preference-jsonl", path=path), tok, rank=r, world=2,
                                    use_chat_template=False) for r in range(2)]
    p0, p1 = _prompts(tok, shards[0].samples), _prompts(tok, shards[1].samples)
    assert not p0 & p1 and len(p0 | p1) == 6
    assert lookup("dataset", "preference-jsonl") is load_preference_jsonl
    split = _ds(type="preference-jsonl", path=path, prompt_template="{question}", holdout=0.5)
    train = load_preference_jsonl(split, tok, rank=0, world=1, use_chat_template=False).samples
    held = load_heldout_pairs(split, tok, use_chat_template=False, n=100)
    tp, hp = _prompts(tok, train), _prompts(tok, held)
    assert tp and hp and not tp & hp and tp | hp == {f"q{i}" for i in range(6)}


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 3: not JSON"),
    ('["a", "b"]', "line 3: a row must be an object"),
    ({"prompt": "q", "chosen": "a"}, "line 3: field 'rejected' must be non-empty text, got None"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "line 3: field 'chosen' must be non-empty text"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "line 3: chosen and rejected are the same text"),
])
def test_preference_jsonl_bad_row_is_one_line_naming_it(tok, tmp_path, bad, message):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path = _write(tmp_path / "p.jsonl", [good, good, bad, good])
    with pytest.raises(ValueError, match=message) as e:
        load_preference_jsonl(_ds(type="preference-jsonl", path=path), tok, rank=0, world=1, use_chat_template=False)
    assert "\n" not in str(e.value) and path in str(e.value)


def test_preference_jsonl_missing_path(tok, tmp_path):
    with pytest.raises(ValueError, match="dataset.path: required"):
        load_preference_jsonl(_ds(type="preference-jsonl"), tok, rank=0, world=1, use_chat_template=False)
    with pytest.raises(ValueError, match="no such file"):
        load_preference_jsonl(_ds(type="preference-jsonl", path=str(tmp_path / "x")), tok, rank=0, world=1,
                              use_chat_template=False)


# ----------------------------------------------------------------------------------------------
# The MFCs, on a stand-in for the score head


class ScoreEngine:
    """Stands in for an engine's score head only: score = linear(mean of token embeddings)."""

    def __init__(self, tokenizer, vocab=600, lr=0.2):
        torch.manual_seed(0)
        self.tokenizer, self.version = tokenizer, 0
        self.emb, self.head = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, 1)
        self.opt = torch.optim.Adam([*self.emb.parameters(), *self.head.parameters()], lr=lr)
        self.micro_batches: list[list[int]] = []

    def _scores(self, seqs):
        return torch.stack([self.head(self.emb(s).mean(0))[0] for s in seqs])

    def scores(self, input_ids, *, max_tokens_per_mb=None):
        with torch.no_grad():
            return list(self._scores(input_ids).unbind())

    def train_batch(self, data, loss_fn, loss_weight_fn, *, max_tokens_per_mb=None, group_sizes=None, **_):
        lens = [len(x) for x in data["input_ids"]]
        mbs = split_by_budget(lens, max_tokens_per_mb or 4096, group_sizes)
        self.micro_batches.append([len(m) for m in mbs])
        packed = [({k: torch.cat([v[i] for i in idx]) for k, v in data.items()}, idx) for idx in mbs]
        total = sum(loss_weight_fn(p) for p, _ in packed)
        stats = {}
        for p, idx in packed:
            out = HeadOutput(cu_seqlens([lens[i] for i in idx]), scores=self._scores([data["input_ids"][i] for i in idx]))
            loss, st = loss_fn(out, p)
            (loss * loss_weight_fn(p) / total).backward()
            for k, v in st.items():
                stats[k] = stats.get(k, 0.0) + float(v) * loss_weight_fn(p) / total
        self.opt.step()
        self.opt.zero_grad()
        self.version += 1
        return stats


def _cfg(dataset, total_steps=10):
    return SimpleNamespace(dataset=dataset, model=SimpleNamespace(use_chat_template=False),
                           trainer=SimpleNamespace(total_steps=total_steps))


def _batch(samples):
    return SequenceSample(list(range(len(samples))), samples)


def test_rm_train_learns_the_training_pairs_with_whole_pairs_per_micro_batch(tok):
    assert mfc_spec("rm_train").head == "score" and mfc_spec("rm_train").trains
    ds = _ds(type="arith-preference", size=64, seed=2, holdout=0.3)
    pairs = load_arith_preference(ds, tok, rank=0, world=1, use_chat_template=False).samples[:16]
    mfc = MFCConfig(name="rm", type="rm_train", model="reward", inputs=["input_ids"], max_tokens_per_mb=50,
                    args={"eval_freq_steps": 5})
    rm, engine = RMTrain(_cfg(ds, total_steps=12), mfc), ScoreEngine(tok)
    history = [rm.run(engine, _batch(pairs)) for _ in range(12)]
    assert all(n > 1 for n in engine.micro_batches[0])  # several micro-batches of whole pairs (pair_loss checks)
    assert len(engine.micro_batches[0]) > 1
    assert history[-1]["rm/loss"] < history[0]["rm/loss"] - 0.2 and history[-1]["rm/accuracy"] > 0.8
    trained = engine.scores([x for p in pairs for x in p["input_ids"]])  # the chosen ones now score higher
    assert sum(float(trained[i] > trained[i + 1]) for i in range(0, 32, 2)) / 16 > 0.8
    assert "rm/eval_accuracy_init" in history[0] and "rm/eval_accuracy" not in history[0]
    evals = [i for i, h in enumerate(history) if "rm/eval_accuracy" in h]
    assert evals == [4, 9, 11]  # after optimizer steps 5 and 10, and the run's last (12)
    held = load_heldout_pairs(ds, tok, use_chat_template=False, n=128)
    s = engine.scores([x for p in held for x in p["input_ids"]])
    assert history[-1]["rm/eval_accuracy"] == pytest.approx(sum(float(s[i] > s[i + 1]) for i in range(0, len(s), 2)) / len(held))


def test_rm_train_refuses_samples_that_are_not_pairs(tok):
    mfc = MFCConfig(name="rm", type="rm_train", model="reward", inputs=["input_ids"])
    three = {"input_ids": [torch.tensor([1, 2]), torch.tensor([1, 3]), torch.tensor([1, 4])]}
    with pytest.raises(ValueError, match="sample 0 holds 3 sequences"):
        RMTrain(_cfg(_ds()), mfc).run(ScoreEngine(tok), _batch([three]))
    with pytest.raises(ValueError, match="needs dataset.holdout > 0"):
        RMTrain.check_config(_cfg(_ds(type="arith-preference")), mfc.model_copy(update={"args": {"eval_freq_steps": 1}}))


def test_rm_inf_gives_one_score_per_sequence(tok):
    engine = ScoreEngine(tok)
    samples = [{"input_ids": [torch.tensor([5, 6, 7]), torch.tensor([5, 9])]}, {"input_ids": [torch.tensor([8])]}]
    out, stats = RMInference(None, MFCConfig(name="rm_inf", type="rm_inf", model="reward")).run(engine, _batch(samples))
    want = engine.scores([torch.tensor([5, 6, 7]), torch.tensor([5, 9]), torch.tensor([8])])
    assert [len(s["rm_scores"]) for s in out.samples] == [2, 1]
    assert [t.shape for t in out.flat("rm_scores")] == [torch.Size([1])] * 3
    assert [t.item() for t in out.flat("rm_scores")] == pytest.approx([w.item() for w in want])
    assert stats["rm/score_mean"] == pytest.approx(sum(w.item() for w in want) / 3)


# ----------------------------------------------------------------------------------------------
# The combiner


def _combine(args, inputs, samples):
    mfc = MFCConfig(name="mix", type="combine_rewards", inputs=inputs, outputs=["rewards"], args=args)
    CombineRewards.check_config(None, mfc)
    return CombineRewards(None, mfc).run(None, _batch(samples))


def test_combine_rewards_weighs_rule_and_model():
    assert not mfc_spec("combine_rewards").needs_model
    t = lambda *v: [torch.tensor([x]) for x in v]  # noqa: E731
    samples = [{"rule_rewards": t(1.0, 0.0), "rm_scores": t(0.5, -2.0)}, {"rule_rewards": t(1.0), "rm_scores": t(3.0)}]
    out, stats = _combine({"rule_weight": 2.0, "rm_weight": 0.5}, ["rule_rewards", "rm_scores"], samples)
    assert [x.item() for x in out.flat("rewards")] == pytest.approx([2 + 0.25, 0 - 1.0, 2 + 1.5])
    assert [len(s["rewards"]) for s in out.samples] == [2, 1]
    assert stats["reward/combined_mean"] == pytest.approx((2.25 - 1 + 3.5) / 3)
    assert stats["reward/rule_mean"] == pytest.approx(2 / 3) and stats["reward/rm_mean"] == pytest.approx(1.5 / 3)
    # the reward model alone: the rule reward need not be an input
    alone = [{k: v for k, v in s.items() if k == "rm_scores"} for s in samples]
    out, stats = _combine({"rule_weight": 0.0}, ["rm_scores"], alone)
    assert [x.item() for x in out.flat("rewards")] == pytest.approx([0.5, -2.0, 3.0]) and "reward/rule_mean" not in stats


@pytest.mark.parametrize("args, inputs, outputs, message", [
    ({}, ["rm_scores"], ["rewards"], "inputs: combine_rewards reads rule_rewards"),
    ({"rm_weight": 0.0}, ["rule_rewards"], ["rewards"], None),
    ({"rule_weight": 0, "rm_weight": 0}, ["rm_scores"], ["rewards"], "both 0"),
    ({"rule_weight": 0}, ["rm_scores"], ["reward"], "writes \\[rewards\\]"),
])
def test_combine_rewards_config_errors(args, inputs, outputs, message):
    mfc = MFCConfig(name="mix", type="combine_rewards", inputs=inputs, outputs=outputs, args=args)
    if message is None:
        CombineRewards.check_config(None, mfc)
    else:
        with pytest.raises(ValueError, match=message):
            CombineRewards.check_config(None, mfc)
