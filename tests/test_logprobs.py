"""The chunked log-prob/entropy kernel against the textbook log-softmax, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

import realcore.backends.logprobs as logprobs_mod
from realcore.backends.batching import token_logprobs
from realcore.backends.logprobs import logprobs_and_entropy


def _reference(x, labels, t):
    logp = F.log_softmax(x.float() / t, -1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("vocab,n,temperature,dtype", [(50, 37, 1.0, torch.float32), (1000, 64, 0.7, torch.float32),
                                                       (300, 20, 1.3, torch.bfloat16)])
@pytest.mark.parametrize("uses", ["logprobs", "entropy", "both"])
def test_values_and_gradients_match_log_softmax(monkeypatch, vocab, n, temperature, dtype, uses):
    monkeypatch.setattr(logprobs_mod, "_CPU_CHUNK_BYTES", 4 * vocab * 7)  # 7 rows a chunk: several chunks, a short last
    gen = torch.Generator().manual_seed(vocab)
    x = (3 * torch.randn(n, vocab, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    def loss(lp, ent):  # only the terms used: the other output's gradient is None, not zeros
        terms = {"logprobs": [lp * g_lp], "entropy": [ent * g_ent], "both": [lp * g_lp, ent * g_ent]}[uses]
        return sum(t.sum() for t in terms)

    lp, ent = logprobs_and_entropy(x, labels, temperature, with_entropy=True)
    ref_lp, ref_ent = _reference(x, labels, temperature)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-5)
    (grad,) = torch.autograd.grad(loss(lp, ent), x)
    (ref_grad,) = torch.autograd.grad(loss(ref_lp, ref_ent), x)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


def test_without_entropy_returns_none_and_trains():
    x = torch.randn(5, 11, requires_grad=True)
    labels = torch.tensor([0, 3, 10, 4, 4])
    lp, ent = logprobs_and_entropy(x, labels)
    assert ent is None
    lp.sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(_reference(x, labels, 1.0)[0].sum(), x)[0])


def test_token_logprobs_are_aligned_to_the_predicted_token_and_zero_at_starts():
    torch.manual_seed(0)
    logits = torch.randn(6, 9)
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    starts = torch.tensor([True, False, False, True, False, False])  # two packed sequences
    lp, ent = token_logprobs(logits, ids, starts, 1.0, True)
    logp = F.log_softmax(logits, -1)
    for t in range(6):
        want = 0.0 if starts[t] else float(logp[t - 1, ids[t]])
        assert float(lp[t]) == pytest.approx(want, abs=1e-6)
        want_ent = 0.0 if starts[t] else float(-(logp[t - 1].exp() * logp[t - 1]).sum())
        assert float(ent[t]) == pytest.approx(want_ent, abs=1e-5)
