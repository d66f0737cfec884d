"""Policy losses, loss aggregation and the off-policy corrections against the papers' formulas, computed
here token by token in plain Python on hand-built tensors; and ppo_update's loss_fn on a HeadOutput."""

import math
from types import SimpleNamespace

import pytest
import torch

from realcore.api.algorithms import PolicyLossInputs, policy_loss, policy_losses_registered
from realcore.api.config import PPOConfig
from realcore.api.engine import HeadOutput
from realcore.mfc.policy_losses import aggregate, loss_weight, off_policy_weights
from realcore.mfc.ppo_functional import kl_loss, ppo_actor_loss
from realcore.mfc.train import PPOArgs, PPOUpdate

torch.set_num_threads(1)

# two sequences packed: [4 tokens | 3 tokens]; position 0 of each is the prompt
CU = torch.tensor([0, 4, 7])
MASK = torch.tensor([0, 1, 1, 1, 0, 1, 1], dtype=torch.float32)
OLD = torch.tensor([0.0, -1.0, -0.5, -2.0, 0.0, -0.3, -1.2])
NEW = torch.tensor([5.0, -0.7, -0.9, -1.0, 9.0, -0.25, -2.0])  # prompt positions hold junk
ADV = torch.tensor([0.0, 1.0, -1.0, -2.0, 0.0, 0.5, 0.5])
SEQ = [range(1, 4), range(5, 7)]  # the loss tokens of each sequence


def run_loss(name, new=NEW, **args):
    lp = new.clone().requires_grad_(True)
    loss, stats = policy_loss(name)(PolicyLossInputs(lp, OLD, ADV, MASK, CU, SimpleNamespace(**args)))
    return lp, loss, stats


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


def test_all_named_losses_are_registered():
    assert {"ppo-clip", "gspo", "cispo", "sapo"} <= set(policy_losses_registered())
    with pytest.raises(KeyError, match="unknown policy loss"):
        policy_loss("nope")


def test_ppo_clip_eq7_with_clip_higher_and_dual_clip():
    lo, hi, c = 0.2, 0.28, 2.0  # token 3: A = -2, r = e: -rA = 5.4 > c|A| = 4, the dual clip binds
    lp, loss, stats = run_loss("ppo-clip", eps_clip=lo, eps_clip_high=hi, c_clip=c)
    want, grads = [], []
    for t in range(7):
        if not MASK[t]:
            want.append(None)
            continue
        r, a = math.exp(NEW[t] - OLD[t]), float(ADV[t])
        # eq. 7 as a loss: -min(r A, clip(r, 1 - lo, 1 + hi) A)
        unclipped, clipped = r * a, min(max(r, 1 - lo), 1 + hi) * a
        L = -min(unclipped, clipped)
        g = -r * a if unclipped <= clipped else 0.0  # d/dlogp of the term min took (clipped: no gradient)
        if a < 0 and -c * a < L:  # dual clip (Ye et al. 2020): bounded at -c A for A < 0
            L, g = -c * a, 0.0
        want.append(L)
        grads.append(g)
    for t in range(7):
        if want[t] is not None:
            assert close(loss[t], want[t]), (t, float(loss[t]), want[t])
    # the loss on the mask, through token-mean: gradient of each token's term / n_tokens
    agg = aggregate(loss, MASK, CU, "token-mean")
    agg.backward()
    assert close(lp.grad[MASK.bool()], [g / 5 for g in grads])
    assert close(lp.grad[~MASK.bool()], [0.0, 0.0])
    assert 0 < float(stats["clipfrac"]) < 1 and float(stats["dual_clipfrac"]) > 0


def test_ppo_clip_token_mean_matches_the_existing_ppo_actor_loss():
    _, loss, _ = run_loss("ppo-clip", eps_clip=0.2, c_clip=3.0)
    old, _ = ppo_actor_loss(NEW, OLD, ADV, MASK, eps_clip=0.2, c_clip=3.0)
    assert close(aggregate(loss, MASK, CU, "token-mean"), old)


def test_gspo_sequence_ratio_clipped_per_sequence():
    # Zheng et al. 2025: s_i = exp(1/|y_i| sum_t log(pi/pi_old)); J_i = min(s_i A_i, clip(s_i, 1-lo, 1+hi) A_i)
    lo, hi = 0.1, 0.1
    adv = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, -0.5, -0.5])  # GSPO: one advantage per sequence
    lp = NEW.clone().requires_grad_(True)
    loss, _ = policy_loss("gspo")(PolicyLossInputs(lp, OLD, adv, MASK, CU, SimpleNamespace(eps_clip=lo, eps_clip_high=hi)))
    obj = 0.0
    for toks in SEQ:
        a = float(adv[toks[0]])
        s = math.exp(sum(float(NEW[t] - OLD[t]) for t in toks) / len(toks))
        L = -min(s * a, min(max(s, 1 - lo), 1 + hi) * a)
        for t in toks:  # the sequence's value on every one of its tokens
            assert close(loss[t], L)
        unclipped = s * a <= min(max(s, 1 - lo), 1 + hi) * a
        obj += L
        # gradient of -s_i A_i / n_seqs wrt log pi_t: -A s / |y_i| / 2 (seq-mean-token-mean over 2 sequences)
        want_g = -a * s / len(toks) / 2 if unclipped else 0.0
        agg = aggregate(loss, MASK, CU, "seq-mean-token-mean")
        g, = torch.autograd.grad(agg, lp, retain_graph=True)
        assert close(g[list(toks)], [want_g] * len(toks))
    assert close(aggregate(loss, MASK, CU, "seq-mean-token-mean"), obj / 2)


def test_cispo_clipped_stop_gradient_weight_times_logprob():
    # MiniMax-M1 (CISPO): J = sum_t sg(clip(r_t, 1 - lo, 1 + hi)) A_t log pi_t
    lo, hi = 1.0, 0.5  # no lower bound (as MiniMax-M1), upper 1.5
    lp, loss, _ = run_loss("cispo", eps_clip=lo, eps_clip_high=hi)
    loss.sum().backward()
    for t in range(7):
        if MASK[t]:
            w = min(max(math.exp(NEW[t] - OLD[t]), 1 - lo), 1 + hi)
            assert close(loss[t], -w * float(ADV[t]) * float(NEW[t]))
            assert close(lp.grad[t], -w * float(ADV[t]))  # the weight carries no gradient
        else:
            assert close(lp.grad[t], 0.0)


def test_sapo_soft_gate():
    # Gao et al. 2025: f(r) = 4/tau sigmoid(tau (r - 1)), tau_pos for A > 0, tau_neg otherwise; L = -f(r) A;
    # d f / d log pi = 4 sigmoid (1 - sigmoid) r: 1 on-policy, smaller off-policy
    tp, tn = 1.0, 1.05
    lp, loss, _ = run_loss("sapo", sapo_tau_pos=tp, sapo_tau_neg=tn)
    loss.sum().backward()
    for t in range(7):
        if not MASK[t]:
            continue
        r, a = math.exp(NEW[t] - OLD[t]), float(ADV[t])
        tau = tp if a > 0 else tn
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        assert close(loss[t], -4 / tau * sig * a)
        assert close(lp.grad[t], -4 * sig * (1 - sig) * r * a)
    # on-policy, the gradient is the plain policy gradient -A d log pi
    lp2, loss2, _ = run_loss("sapo", new=OLD.clone())
    loss2.sum().backward()
    assert close(lp2.grad[MASK.bool()], -ADV[MASK.bool()])


def test_aggregations():
    L = torch.tensor([9.0, 1.0, 2.0, 3.0, float("inf"), 4.0, 8.0])  # inf off the mask adds nothing
    # token-mean: (1+2+3+4+8)/5; seq-mean-token-sum: ((1+2+3) + (4+8))/2; seq-mean-token-mean: (2 + 6)/2
    assert close(aggregate(L, MASK, CU, "token-mean"), 18 / 5)
    assert close(aggregate(L, MASK, CU, "seq-mean-token-sum"), 9.0)
    assert close(aggregate(L, MASK, CU, "seq-mean-token-mean"), 4.0)
    # a sequence without loss tokens is left out of the sequence means; all masked: 0
    m = torch.tensor([0, 1, 1, 1, 0, 0, 0], dtype=torch.float32)
    assert close(aggregate(L, m, CU, "seq-mean-token-mean"), 2.0)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert float(aggregate(L, torch.zeros(7), CU, mode)) == 0.0
    data = {"loss_mask": m, "cu_seqlens": CU}
    assert loss_weight(data, "token-mean") == 3.0 and loss_weight(data, "seq-mean-token-mean") == 1.0
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(L, MASK, CU, "sum")


def test_tis_and_mis_weights():
    behav = torch.tensor([0.0, -1.0, -1.0, -1.0, -1.0])
    recomputed = torch.tensor([3.0, -1.0, -0.2, -2.5, -1.5])  # w = e^0, e^0.8, e^-1.5, e^-0.5 on the mask
    mask = torch.tensor([0, 1, 1, 1, 1])
    C = 2.0
    w = [math.exp(float(recomputed[t] - behav[t])) for t in range(5)]
    tis, _ = off_policy_weights(behav, recomputed, mask, "tis", C)
    assert close(tis, [0.0] + [min(x, C) for x in w[1:]])  # Yao et al.: min(w, C)
    mis, stats = off_policy_weights(behav, recomputed, mask, "mis", C)
    assert close(mis, [0.0] + [1.0 if 1 / C <= x <= C else 0.0 for x in w[1:]])  # e^0.8 > 2, e^-1.5 < 1/2 dropped
    assert close(stats["off_policy/masked_frac"], 2 / 4)
    none, _ = off_policy_weights(behav, recomputed, mask, "none", C)
    assert close(none, [0.0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="off_policy"):
        off_policy_weights(behav, recomputed, mask, "clip", C)


# ---------------------------------------------------------------- ppo_update's loss_fn on a HeadOutput


def make_update(ppo=None, **args):
    u = PPOUpdate.__new__(PPOUpdate)
    u.ppo = ppo or PPOConfig()
    u.args, u._gaps, u._before_step = PPOUpdate.resolve(PPOArgs(**args), u.ppo), None, lambda: True
    return u


def head(lp):
    return HeadOutput(CU, logprobs=lp, entropy=torch.zeros(7))


def test_loss_fn_defaults_reproduce_the_previous_ppo_update_loss():
    # today's behaviour: ppo_actor_loss (token mean) + kl_coef x kl_loss, from the ppo: section alone
    ppo = PPOConfig(kl_coef=0.1, eps_clip=0.15, c_clip=4.0)
    ref = torch.tensor([0.0, -0.8, -0.6, -1.5, 0.0, -0.2, -1.0])
    data = {"loss_mask": MASK.long(), "behav_logprobs": OLD, "advantages": ADV, "ref_logprobs": ref}
    loss, stats = make_update(ppo).loss_fn(head(NEW), data)
    pg, _ = ppo_actor_loss(NEW, OLD, ADV, MASK, eps_clip=0.15, c_clip=4.0)
    assert close(loss, pg + 0.1 * kl_loss(NEW, ref, MASK, "k3"))
    # decoupled mode with a cap, as before
    ppo = PPOConfig(use_decoupled_loss=True, behav_imp_weight_cap=1.5)
    prox = torch.tensor([0.0, -0.9, -0.4, -2.2, 0.0, -0.3, -0.5])
    data = {"loss_mask": MASK.long(), "behav_logprobs": OLD, "advantages": ADV, "prox_logprobs": prox}
    loss, _ = make_update(ppo).loss_fn(head(NEW), data)
    want, _ = ppo_actor_loss(NEW, OLD, ADV, MASK, eps_clip=0.2, prox_logprobs=prox, behav_imp_weight_cap=1.5)
    assert close(loss, want)


def test_loss_fn_tis_weights_each_token_and_takes_the_ratio_against_the_recomputed():
    prox = torch.tensor([0.0, -0.9, -0.4, -2.2, 0.0, -0.3, -0.5])
    data = {"loss_mask": MASK.long(), "behav_logprobs": OLD, "advantages": ADV, "prox_logprobs": prox}
    loss, stats = make_update(off_policy="tis", off_policy_threshold=1.5).loss_fn(head(NEW), data)
    total = 0.0
    for t in range(7):
        if MASK[t]:
            r, a = math.exp(NEW[t] - prox[t]), float(ADV[t])
            L = -min(r * a, min(max(r, 0.8), 1.2) * a)
            total += min(math.exp(prox[t] - OLD[t]), 1.5) * L
    assert close(loss, total / 5)
    assert "ppo/off_policy/weight_mean" in stats


def test_loss_fn_gathers_the_behaviour_gap_only_before_any_step():
    data = {"loss_mask": MASK.long(), "behav_logprobs": OLD, "advantages": ADV}
    u = make_update()
    u._gaps, before = [], [True]
    u._before_step = lambda: before[0]
    u.loss_fn(head(NEW), data)
    before[0] = False
    u.loss_fn(head(NEW + 1), data)  # after a step: the weights no longer those that sampled
    assert len(u._gaps) == 1 and close(u._gaps[0], (NEW - OLD)[MASK.bool()].abs())
