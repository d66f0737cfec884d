"""The built-in engine's speed paths on the tiny models: the preallocated (slot) KV cache under
continuous batching, interruption and growth gives HF's greedy tokens; bf16 mode's log-probs stay
close to a float32 recomputation; a freed slot is reused."""

import copy

import pytest
import torch

from realcore.api.config import GenerationConfig, ModelConfig, TinyModelConfig
from realcore.backends import onednn_linear, precision
from realcore.backends.generation import GenerationEngine
from realcore.backends.models import load_model, load_tokenizer, prepare_model
import test_generation
from tiny_models import spread_weights

torch.set_num_threads(1)
TEXTS = [*test_generation.TEXTS, "she buys eggs"]  # prompts of different lengths
NO_BF16 = precision.bf16_unsupported("cpu")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_tok(request, tmp_path_factory):
    cfg = ModelConfig(cache_dir=str(tmp_path_factory.mktemp("models")), tiny=TinyModelConfig(family=request.param))
    path = prepare_model(cfg, seed=0)
    model, tok = load_model(path), load_tokenizer(path)
    spread_weights(model, seed=1)
    return model, tok


def _prompts(tok) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in TEXTS]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens for one prompt alone (no padding), EOS ignored."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy(n: int, batch: int = 8) -> GenerationConfig:
    return GenerationConfig(greedy=True, ignore_eos=True, max_new_tokens=n, max_batch_size=batch)


def _engine(model, tok, dtype, **kw) -> GenerationEngine:
    """dtype None: the engine shares `model` (a trainer's, untouched); "float32": the engine owns a
    copy (a server's: its linears run through oneDNN)."""
    return GenerationEngine(model if dtype is None else copy.deepcopy(model), tok, dtype=dtype, **kw)


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_continuous_batching_with_joins_interrupts_and_growth_matches_hf(model_tok, dtype):
    """Rows of different lengths leave at different steps, a request joins mid-decode, one is
    aborted, the batch is retracted and readmitted, and one row outgrows the first capacity (64
    columns): every row's tokens are HF's greedy tokens for its prompt alone."""
    model, tok = model_tok
    prompts = _prompts(tok)
    lengths = [20, 9, 90, 14, 30, 25]
    engine = _engine(model, tok, dtype)
    rids = {engine.add_request(p, _greedy(n, batch=4)): i for i, (p, n) in enumerate(zip(prompts[:4], lengths))}
    done: dict[int, list[int]] = {}
    aborted = None
    for step in range(200):
        if not engine.has_unfinished():
            break
        done.update({rid: res.output_ids for rid, res in engine.step()})
        if step == 3:  # joins mid-decode (waits for a free row when the batch is full)
            rids[engine.add_request(prompts[4], _greedy(lengths[4], batch=4))] = 4
        if step == 5:  # interrupted: partial output, and its row is free for the next request
            aborted_rid = next(r for r, i in rids.items() if i == 3)
            [(rid, res)] = engine.abort([aborted_rid])
            assert res.finish_reason == "abort" and 0 < len(res.output_ids) < lengths[3]
            aborted = res.output_ids
            rids[engine.add_request(prompts[5], _greedy(lengths[5], batch=4))] = 5
        if step == 12:  # a weight-update pause: the running rows resume from their prefixes
            assert engine.retract() > 0
    assert not engine.has_unfinished()
    assert engine._kv.capacity == 0  # idle: the cache's memory was given back
    for rid, i in rids.items():
        if i == 3:
            continue
        assert done[rid] == _hf_greedy(model, prompts[i], lengths[i]), f"prompt {i}"
    assert aborted == _hf_greedy(model, prompts[3], len(aborted))


def test_a_slot_freed_by_an_interruption_is_reused(model_tok):
    """The aborted row's slot takes the next request without the cache growing, and its stale
    columns (a longer prompt's) do not leak into the newcomer's attention."""
    model, tok = model_tok
    prompts = _prompts(tok)
    engine = GenerationEngine(model, tok)
    long_rid = engine.add_request(prompts[3], _greedy(40, batch=2))  # the longest prompt
    other = engine.add_request(prompts[0], _greedy(12, batch=2))
    for _ in range(4):
        engine.step()
    slots, capacity = engine._kv.slots, engine._kv.capacity
    assert slots == 2
    engine.abort([long_rid])
    short_rid = engine.add_request(prompts[4], _greedy(12, batch=2))  # a 1-token prompt
    results = {}
    while engine.has_unfinished():
        results.update({rid: res.output_ids for rid, res in engine.step()})
        assert engine._kv.slots in (0, slots)  # never grew (0 once idle)
    assert engine._kv.capacity in (0, capacity)
    assert results[short_rid] == _hf_greedy(model, prompts[4], 12)
    assert results[other] == _hf_greedy(model, prompts[0], 12)


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_logprobs_equal_a_full_forward_in_float32(model_tok, dtype):
    model, tok = model_tok
    prompts = _prompts(tok)
    gconfig = GenerationConfig(temperature=0.8, max_new_tokens=24, max_batch_size=3)
    for prompt, res in zip(prompts, _engine(model, tok, dtype, seed=3).generate(prompts, gconfig)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + res.output_ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / 0.8, dim=-1).gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=1e-5, rtol=0)


@pytest.mark.skipif(NO_BF16 is not None, reason=f"no bf16 on this CPU: {NO_BF16}")
def test_bf16_logprobs_are_close_to_the_float32_recomputation(model_tok):
    """bf16 linears, fp32 elsewhere: sampled tokens' log-probs against the trainer's fp32 ones.

    The bound that holds per token is not 2e-2: rounding this model's weights to bf16 alone (fp32
    compute) moves some log-probs by up to ~3e-2 (its weights are drawn at std 0.15, so logits are
    sharp), and the engine adds bf16 rounding of each matmul's input and output (max ~6e-2 here).
    What holds: a median under 2e-2 and every token under 0.1 (SmolLM2-135M: the bench prints
    the distribution)."""
    model, tok = model_tok
    prompts = _prompts(tok)
    engine = GenerationEngine(copy.deepcopy(model), tok, seed=2, dtype="bfloat16")
    # The copy's decoder linears were converted, not the caller's model.
    assert engine.model.get_decoder().layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert model.get_decoder().layers[0].mlp.up_proj.weight.dtype == torch.float32
    errors = []
    gconfig = GenerationConfig(max_new_tokens=32, max_batch_size=4)
    for prompt, res in zip(prompts, engine.generate(prompts, gconfig)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + res.output_ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]
        errors.append((torch.tensor(res.output_logprobs) - expected).abs())
    errors = torch.cat(errors)
    assert errors.median() < 2e-2 and errors.max() < 0.1, f"max {errors.max():.3g}, median {errors.median():.3g}"
    assert errors.max() > 1e-4  # it did run in bf16


@pytest.mark.parametrize("dtype", [None, "float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    NO_BF16 is not None, reason=f"no bf16 on this CPU: {NO_BF16}"))])
def test_a_group_is_prefilled_once(model_tok, dtype):
    """GRPO's group, one prompt n times, is prefilled once per distinct sequence (3 rows for 7
    requests here), and each request still gets what it gets alone: the greedy tokens and log-probs
    of its prompt alone; sampled, the members of a group draw their own tokens."""
    model, tok = model_tok
    p = _prompts(tok)
    group = [p[0]] * 4 + [p[1], p[2], p[0]]
    engine = _engine(model, tok, dtype)
    forward = engine.model.forward

    def generate(gconfig):
        """engine.generate(group), and the rows of each prefill it ran."""
        rows = []

        def counting(**kw):
            if kw["input_ids"].shape[1] > 1:  # a prefill (a decode step feeds one token per row)
                rows.append(kw["input_ids"].shape[0])
            return forward(**kw)

        engine.model.forward = counting  # (the model may be the fixture's: restored below)
        try:
            return engine.generate(group, gconfig), rows
        finally:
            del engine.model.forward

    greedy, rows = generate(_greedy(12))
    assert rows == [3]
    alone = {i: _engine(model, tok, dtype).generate([p[i]], _greedy(12))[0] for i in range(3)}
    for prompt, res in zip(group, greedy):
        ref = alone[p.index(prompt)]
        assert res.output_ids == ref.output_ids
        assert res.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4 if dtype != "bfloat16" else 2e-2)

    sampled, rows = generate(GenerationConfig(max_new_tokens=12, max_batch_size=8, ignore_eos=True))
    assert rows == [3]
    assert len({tuple(r.output_ids) for r in sampled[:4]}) == 4  # one prefill, four draws
    if dtype != "bfloat16":  # each sampled token's log-prob is the full forward's (bf16's: above)
        for prompt, res in zip(group, sampled):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + res.output_ids])).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    NO_BF16 is not None, reason=f"no bf16 on this CPU: {NO_BF16}"))])
def test_weight_updates_reach_every_parameter(model_tok, dtype):
    """load_weights (fp32 tensors) gives what an engine built on the new weights gives: the bf16
    linears take the cast, the fp32 rest (norms, embeddings, output projection) the values; in
    float32 the oneDNN linears read the updated parameters."""
    model, tok = model_tok
    prompts = _prompts(tok)[:3]
    new = copy.deepcopy(model)
    spread_weights(new, seed=7)
    with torch.no_grad():
        for p in new.parameters():
            if p.dim() == 1:
                p.mul_(1.5)  # norms (and biases) change too
    gconfig = GenerationConfig(max_new_tokens=8, max_batch_size=3)
    engine = GenerationEngine(copy.deepcopy(model), tok, seed=4, dtype=dtype)
    if dtype == "float32" and torch.backends.mkldnn.is_available():  # every linear (the head too) runs through oneDNN
        linears = [m for m in engine.model.modules() if type(m) is torch.nn.Linear]
        assert linears and all(m.forward.func is onednn_linear.linear for m in linears)
    before = engine.generate(prompts, gconfig)
    engine.load_weights({n: t.clone() for n, t in new.state_dict().items()})
    engine.next_rid = 0  # the same samplers as the fresh engine's
    after = engine.generate(prompts, gconfig)
    fresh = GenerationEngine(copy.deepcopy(new), tok, seed=4, dtype=dtype).generate(prompts, gconfig)
    assert [r.output_logprobs for r in after] == [r.output_logprobs for r in fresh]
    assert [r.output_logprobs for r in after] != [r.output_logprobs for r in before]


@pytest.mark.skipif(NO_BF16 is not None, reason=f"no bf16 on this CPU: {NO_BF16}")
def test_bf16_output_projection_is_float32_where_it_counts():
    """The bf16 head (a SmolLM2-sized vocabulary, 8000 here): its top-K logits per row are the float32
    ones, so greedy picks and the log-probs of likely tokens are float32's, `exact` gives any sampled
    token's float32 logit; the bf16 copy follows
    in-place updates of the weight (and a new weight tensor)."""
    from realcore.backends.generation import _Bf16Head

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 8000, bias=False)
    x = torch.randn(5, 1, 64) * 4

    def check(w):
        ref = x @ w.t()
        out = head(x)
        top = ref.topk(_Bf16Head.TOP_K // 2, dim=-1).indices  # well inside the recomputed top-K
        assert torch.allclose(out.gather(-1, top), ref.gather(-1, top), atol=1e-5)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
        err = (out.log_softmax(-1) - ref.log_softmax(-1)).gather(-1, top).abs().max()
        assert err < 2e-3, err  # the tail's bf16 rounding moves the normaliser a little, no more
        assert (out - ref).abs().max() > 1e-4  # the tail is bf16
        tail = ref[:, -1].argmin(-1)  # a token far outside the top-K: the engine corrects its log-prob
        assert torch.allclose(head.forward.exact(tail), ref[:, -1].gather(-1, tail[:, None])[:, 0], atol=1e-5)

    with torch.no_grad():
        _Bf16Head.attach(head)
        check(head.weight)
        head.weight.copy_(torch.randn_like(head.weight))  # a weight update in place
        check(head.weight)
        head.weight = torch.nn.Parameter(torch.randn_like(head.weight))  # a new tensor
        check(head.weight)


@pytest.mark.skipif(NO_BF16 is not None, reason=f"no bf16 on this CPU: {NO_BF16}")
def test_bf16_engine_reports_the_sampled_tokens_float32_logit(model_tok):
    """The engine's log-prob of a sampled token uses its float32 logit from the head (`exact`): a
    head whose exact logits read 0.25 higher moves every log-prob by 0.25 / temperature."""
    model, tok = model_tok
    prompts = _prompts(tok)[:3]
    gconfig = GenerationConfig(greedy=True, temperature=0.5, ignore_eos=True, max_new_tokens=4, max_batch_size=3)
    engine = GenerationEngine(copy.deepcopy(model), tok, seed=3, dtype="bfloat16")
    base = engine.generate(prompts, gconfig)
    exact = engine._head.exact
    engine._head.exact = lambda tokens, rows=None: exact(tokens, rows) + 0.25
    shifted = engine.generate(prompts, gconfig)
    for a, b in zip(base, shifted):
        assert a.output_ids == b.output_ids
        assert b.output_logprobs == pytest.approx([lp + 0.5 for lp in a.output_logprobs], abs=1e-5)


def test_bf16_is_refused_where_the_cpu_lacks_it(model_tok, monkeypatch):
    model, tok = model_tok
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda cpuinfo="/proc/cpuinfo": False)
    with pytest.raises(ValueError, match="no bf16 instructions"):
        GenerationEngine(copy.deepcopy(model), tok, dtype="bfloat16")


@pytest.mark.skipif(NO_BF16 is not None, reason=f"no bf16 on this CPU: {NO_BF16}")
def test_the_generation_server_runs_its_engine_in_the_dtype_it_is_given(model_tok):
    from realcore.backends.genserver.engine_loop import EngineLoop

    model, tok = model_tok
    loop = EngineLoop(copy.deepcopy(model), tok, seed=0, dtype="bfloat16")
    assert loop.engine.model is loop.model  # weight updates and LoRA merges see the converted model
    assert loop.model.get_decoder().layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert EngineLoop(copy.deepcopy(model), tok, seed=0).model.get_decoder().layers[0].self_attn.q_proj.weight.dtype \
        == torch.float32
