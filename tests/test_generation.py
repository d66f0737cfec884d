"""The built-in generation engine against HF `generate` and a full forward pass, on the tiny model."""

import pytest
import torch

from realcore.api.config import GenerationConfig, ModelConfig
from realcore.backends.generation import GenerationEngine
from realcore.backends.models import load_model, load_tokenizer, prepare_model
from tiny_models import spread_weights

torch.set_num_threads(1)
TEXTS = [
    "Question: What is 3 + 5?\nAnswer:",
    "hi",
    "the cat has many apples and the dogs have more books so",
    "Question: What is 12 * 4?\nAnswer: let us think step by step",
    "7",
]


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    path = prepare_model(ModelConfig(cache_dir=str(tmp_path_factory.mktemp("models"))), seed=0)
    model, tok = load_model(path), load_tokenizer(path)
    spread_weights(model, seed=1)
    return model, tok


@pytest.fixture(scope="module")
def prompts(model_tok):
    return [model_tok[1](t)["input_ids"] for t in TEXTS]


def _greedy(**kw) -> GenerationConfig:
    return GenerationConfig(greedy=True, **kw)


def test_greedy_matches_hf_generate(model_tok, prompts):
    model, tok = model_tok
    results = GenerationEngine(model, tok).generate(prompts, _greedy(max_new_tokens=24))
    for prompt, res in zip(prompts, results):
        hf = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, len(prompt) :].tolist()
        assert res.output_ids == hf
    assert len({tuple(r.output_ids) for r in results}) == len(results)  # outputs are not degenerate


def test_batched_equals_one_at_a_time(model_tok, prompts):
    model, tok = model_tok
    alone = [GenerationEngine(model, tok).generate([p], _greedy(max_new_tokens=16))[0] for p in prompts]
    for max_batch_size in (2, 5):
        batched = GenerationEngine(model, tok).generate(prompts, _greedy(max_new_tokens=16, max_batch_size=max_batch_size))
        assert [r.output_ids for r in batched] == [r.output_ids for r in alone]
        for b, a in zip(batched, alone):
            torch.testing.assert_close(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-4, rtol=0)


def test_requests_join_and_leave_a_running_batch(model_tok, prompts):
    """Continuous batching: requests of different lengths join between steps and leave when done."""
    model, tok = model_tok
    lengths = [3, 12, 6, 9, 4]
    alone = [GenerationEngine(model, tok).generate([p], _greedy(max_new_tokens=n))[0] for p, n in zip(prompts, lengths)]
    engine = GenerationEngine(model, tok)
    rids = [engine.add_request(p, _greedy(max_new_tokens=n, max_batch_size=3)) for p, n in zip(prompts[:4], lengths)]
    done = {}
    for _ in range(5):
        done.update(engine.step())
    rids.append(engine.add_request(prompts[4], _greedy(max_new_tokens=lengths[4], max_batch_size=3)))  # late arrival
    while engine.has_unfinished():
        done.update(engine.step())
        assert len(engine._running) <= 3
    assert [done[r].output_ids for r in rids] == [a.output_ids for a in alone]
    assert all(done[r].finish_reason == "length" for r in rids)


def test_logprobs_match_full_forward(model_tok, prompts):
    """output_logprobs = log_softmax(logits / T) of the unfiltered distribution (what the trainer recomputes)."""
    model, tok = model_tok
    T = 0.7
    gconfig = GenerationConfig(temperature=T, top_k=20, top_p=0.9, max_new_tokens=12, max_batch_size=3)
    results = GenerationEngine(model, tok, seed=5).generate(prompts, gconfig)
    for prompt, res in zip(prompts, results):
        seq = torch.tensor([prompt + res.output_ids])
        with torch.no_grad():
            logits = model(seq).logits[0, len(prompt) - 1 : -1]  # (n_out, V): predicts each output token
        expected = torch.log_softmax(logits / T, dim=-1).gather(1, torch.tensor(res.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=1e-4, rtol=0)


def test_stop_tokens_and_length(model_tok, prompts):
    model, tok = model_tok
    engine = GenerationEngine(model, tok)
    full = engine.generate(prompts[:1], _greedy(max_new_tokens=10))[0]
    assert full.finish_reason == "length" and len(full.output_ids) == 10 == len(full.output_logprobs)

    stop = full.output_ids[3]
    first = full.output_ids.index(stop)
    res = engine.generate(prompts[:1], _greedy(max_new_tokens=10, stop_token_ids=[stop]))[0]
    assert res.finish_reason == "stop"
    assert res.output_ids == full.output_ids[: first + 1]  # the stop token is included

    # The tokenizer's EOS stops generation without being listed.
    engine.eos_token_id = stop
    res = GenerationEngine(model, tok).generate(prompts[:1], _greedy(max_new_tokens=10))[0]
    assert res.output_ids == full.output_ids  # a fresh engine with the real EOS: unaffected
    assert engine.generate(prompts[:1], _greedy(max_new_tokens=10))[0].output_ids == full.output_ids[: first + 1]

    one = engine.generate(prompts, _greedy(max_new_tokens=1))
    assert all(len(r.output_ids) == 1 for r in one)


def test_top_k_1_equals_greedy(model_tok, prompts):
    model, tok = model_tok
    greedy = GenerationEngine(model, tok).generate(prompts, _greedy(max_new_tokens=12))
    top1 = GenerationEngine(model, tok, seed=3).generate(prompts, GenerationConfig(top_k=1, temperature=1.3, max_new_tokens=12))
    assert [r.output_ids for r in top1] == [r.output_ids for r in greedy]


def test_sampling_is_seeded(model_tok, prompts):
    model, tok = model_tok
    group = [prompts[0]] * 4 + prompts[1:]
    gconfig = GenerationConfig(temperature=1.0, max_new_tokens=12, max_batch_size=3)
    a = GenerationEngine(model, tok, seed=7).generate(group, gconfig)
    b = GenerationEngine(model, tok, seed=7).generate(group, gconfig.model_copy(update={"max_batch_size": 64}))
    c = GenerationEngine(model, tok, seed=8).generate(group, gconfig)
    ids = lambda rs: [r.output_ids for r in rs]  # noqa: E731
    assert ids(a) == ids(b)  # same seed: same samples, whatever the batch size
    assert ids(a) != ids(c)
    assert len({tuple(r.output_ids) for r in a[:4]}) > 1  # a GRPO group gets different samples


def test_bad_requests(model_tok):
    model, tok = model_tok
    engine = GenerationEngine(model, tok)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], GenerationConfig())
    with pytest.raises(ValueError, match="positions"):
        engine.add_request([1] * 2040, GenerationConfig(max_new_tokens=16))


def test_the_sampler_draws_each_token_with_its_probability():
    """The inverse CDF runs in two levels over a large vocabulary (chunk sums, then one chunk):
    it must pick the same token as one cumulative sum over the whole row, never a token of zero
    probability, and with the right frequencies, also where the mass sits at chunk edges."""
    from realcore.backends.generation import _CDF_CHUNK, _inverse_cdf

    V = 2 * _CDF_CHUNK + 700  # two whole chunks and a padded one
    probs = torch.zeros(V)
    heavy = [0, _CDF_CHUNK - 1, _CDF_CHUNK, 2 * _CDF_CHUNK - 1, V - 1]  # both sides of each chunk edge
    probs[heavy] = torch.tensor([0.1, 0.15, 0.2, 0.05, 0.1])
    light = torch.arange(1, V - 1, 3)  # every third token shares the rest; the others stay at zero
    light = light[~torch.isin(light, torch.tensor(heavy))]
    probs[light] = 0.4 / len(light)
    gen = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(20):
        u = torch.rand(1000, generator=gen)
        rows = probs.expand(1000, V) * 3.0  # unnormalised, as the engine passes them
        idx = _inverse_cdf(rows, u)
        cdf = rows.cumsum(-1)
        reference = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=V - 1).squeeze(1)
        # They differ only where u falls within float32 rounding of a boundary (~1e-3 of draws here:
        # a cumulative sum over 3k tokens carries ~1e-6 of error, light tokens hold 1e-3 each).
        assert (idx == reference).float().mean() > 0.995
        draws.append(idx)
    idx = torch.cat(draws)
    assert probs[idx].min() > 0  # never a zero-probability token
    freq = torch.bincount(idx, minlength=V).float() / len(idx)
    for t in heavy:
        assert abs(freq[t] - probs[t]) < 0.012, (t, freq[t], probs[t])
    assert abs(freq[light].sum() - 0.4) < 0.015

    # u next to 1 with the row's last tokens at zero: the chunk's own cumulative sum can fall
    # short of what the chunk sums promised, and the pick must still be a real, possible token.
    rows = torch.rand(800, V, generator=torch.Generator().manual_seed(0)) ** 8
    rows[:, -5:] = 0
    idx = _inverse_cdf(rows, torch.full((800,), 1 - 2**-24))
    assert idx.max() < V and rows.gather(1, idx[:, None]).min() > 0
    # ... also where whole chunks at the end hold nothing (a top-k's zeros, a padded vocabulary), and
    # for u = 0 where the first tokens hold nothing: the pick is a possible token, with no second pass.
    rows[:, -(_CDF_CHUNK + 500):] = 0
    rows[:, :700] = 0
    for u in (1 - 2**-24, 0.0):
        idx = _inverse_cdf(rows, torch.full((800,), u))
        assert idx.max() < V - _CDF_CHUNK - 500 and idx.min() >= 700 and rows.gather(1, idx[:, None]).min() > 0


def test_sampled_rows_and_greedy_rows_share_a_batch():
    """Greedy, plain and top-k/top-p rows in one batch each get their own rule."""
    from realcore.backends.generation import sample_tokens

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 3
    rngs = [torch.Generator().manual_seed(i) for i in range(6)]
    tokens, logprobs = sample_tokens(logits, temperature=[1.0, 1.0, 0.5, 1.0, 1.0, 2.0], top_k=[0, 0, 0, 1, 0, 0],
                                     top_p=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], greedy=[True, False, False, False, True, False],
                                     rngs=rngs)
    assert tokens[0] == logits[0].argmax() and tokens[4] == logits[4].argmax()
    assert tokens[3] == logits[3].argmax()  # top-k 1
    temps = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 2.0])[:, None]
    expected = torch.log_softmax(logits / temps, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


@pytest.mark.parametrize("sync_free", [False, True])
def test_top_p_alone_takes_the_nucleus_of_the_whole_distribution(sync_free):
    """Without top-k, top-p's nucleus is of the whole distribution (as transformers' warper), whether
    the search stops at the first 64 tokens (they hold enough mass) or sorts every token: with
    probabilities 0.8, 0.05, 0.05, then 0.02 over 61 tokens and 0.08 over the rest, top_p 0.88 keeps
    the first three (0.85 lies above the third). Renormalising by the first 64 tokens' mass (0.92)
    would keep two."""
    from realcore.backends.generation import sample_tokens

    probs = torch.cat([torch.tensor([0.8, 0.05, 0.05]), torch.full((61,), 0.02 / 61), torch.full((936,), 0.08 / 936)])
    n = 600
    logits = probs.log().expand(n, -1)
    tokens, _ = sample_tokens(logits, temperature=[1.0] * n, top_k=[0] * n, top_p=[0.88] * n, greedy=[False] * n,
                              rngs=[torch.Generator().manual_seed(i) for i in range(n)], sync_free=sync_free)
    counts = torch.bincount(tokens, minlength=1000)
    assert counts[3:].sum() == 0
    assert abs(counts[2] / n - 0.05 / 0.9) < 0.03 and abs(counts[0] / n - 0.8 / 0.9) < 0.04
