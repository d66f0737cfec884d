"""The cost models of bench/async_sim.py (bench/sim_costs.py): what they promise the benchmark."""

import json
import time

import pytest

from bench.sim_costs import ENV, SimCosts, SimGenerationEngine
from realcore.api.config import GenerationConfig


class _Tokenizer:
    eos_token_id = 0

    def __len__(self):
        return 512


def _engine(monkeypatch, **costs) -> SimGenerationEngine:
    monkeypatch.setenv(ENV, json.dumps(costs))
    return SimGenerationEngine(None, _Tokenizer(), seed=3)


def test_decode_step_costs_the_same_at_any_batch(monkeypatch):
    gconfig = GenerationConfig(max_new_tokens=50, max_batch_size=32)
    times = {}
    for batch in (1, 32):
        e = _engine(monkeypatch, decode_step_s=0.01, prefill_s_per_token=0.0, len_median=1e6)  # every response hits the cap
        t0 = time.perf_counter()
        out = e.generate([[1, 2, 3]] * batch, gconfig)
        times[batch] = time.perf_counter() - t0
        assert [len(r.output_ids) for r in out] == [50] * batch and {r.finish_reason for r in out} == {"length"}
    # 49 decode steps (the first token comes from the prefill) whatever the batch
    assert times[1] == pytest.approx(0.49, abs=0.1) and times[32] == pytest.approx(0.49, abs=0.1), times
    # over the max batch, requests wait for a slot: two rounds
    e = _engine(monkeypatch, decode_step_s=0.01, prefill_s_per_token=0.0, len_median=1e6)
    t0 = time.perf_counter()
    e.generate([[1]] * 33, gconfig)
    assert time.perf_counter() - t0 == pytest.approx(0.99, abs=0.15)


def test_lengths_are_lognormal_capped_and_never_eos(monkeypatch):
    costs = SimCosts(len_median=40, len_sigma=1.0)
    e = _engine(monkeypatch, decode_step_s=0.0, prefill_s_per_token=0.0, len_median=40, len_sigma=1.0)
    out = e.generate([[5, 6]] * 2000, GenerationConfig(max_new_tokens=256, max_batch_size=2000))
    lens = sorted(len(r.output_ids) for r in out)
    assert lens[1000] == pytest.approx(40, rel=0.15)  # the median
    assert sum(lens) / len(lens) == pytest.approx(costs.mean_len(256), rel=0.1)
    at_cap = sum(n == 256 for n in lens) / len(lens)
    assert 0.01 < at_cap < 0.06, at_cap  # a few reach the cap: P(L > 256) = 3.2% at these parameters
    assert all(len(r.output_ids) == 256 for r in out if r.finish_reason == "length")
    assert all(r.finish_reason == "stop" for r in out if len(r.output_ids) < 256)
    assert all(0 not in r.output_ids for r in out)  # the tokenizer's EOS
    assert costs.max_len(20, 256) > 3 * costs.mean_len(256)  # the long tail a sync step waits for


def test_an_interrupted_response_keeps_its_length(monkeypatch):
    gconfig = GenerationConfig(max_new_tokens=300, max_batch_size=8)
    whole = _engine(monkeypatch, decode_step_s=0.0, len_median=80).generate([[7, 8, 9]], gconfig)[0]
    assert len(whole.output_ids) > 10
    e = _engine(monkeypatch, decode_step_s=0.0, len_median=80)  # the same seed: the same draw
    e.add_request([7, 8, 9], gconfig)
    for _ in range(5):
        e.step()
    ((_, part),) = e.abort()
    assert part.finish_reason == "abort" and len(part.output_ids) == 5
    # the rollout worker resubmits prompt + output with the budget left (gen_client.generate_resumable)
    rest = e.generate([[7, 8, 9] + part.output_ids], gconfig.model_copy(update={"max_new_tokens": 295}))[0]
    assert len(part.output_ids) + len(rest.output_ids) == len(whole.output_ids)
    assert rest.finish_reason == whole.finish_reason
    # a request the engine has not seen draws a new length
    e.retract()
    assert not e.has_unfinished()
