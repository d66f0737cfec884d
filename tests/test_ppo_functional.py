"""PPO / GRPO math against hand-computed values (the arithmetic is in the comments)."""

import math

import pytest
import torch

from realcore.mfc.ppo_functional import group_advantages, kl_estimate, kl_loss, masked_mean, ppo_actor_loss, sft_loss

torch.set_num_threads(1)
LN2 = math.log(2.0)


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


# ---------------------------------------------------------------- masked_mean


def test_masked_mean_all_dims_rows_weights_and_empty():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[1, 0, 1], [1, 0, 0]])
    assert close(masked_mean(x, m), (1 + 3 + 4) / 3)  # inf is masked out, not 0 * inf = nan
    assert close(masked_mean(x, m, dim=1), [2.0, 4.0])  # row means (1+3)/2, 4/1
    # Float mask = weights: (1*1 + 0.5*3) / 1.5 = 2.5 / 1.5
    assert close(masked_mean(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 0.5])), 2.5 / 1.5)
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0
    with pytest.raises(ValueError, match="shape"):
        masked_mean(x, torch.ones(3))


# ---------------------------------------------------------------- group advantages


REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # groups [1,0,0,1 | 1,1,1,1]


def test_group_norm_grpo():
    eps = 1e-6
    adv = group_advantages(REWARDS, [4, 4], norm="group", eps=eps)
    # group 1: mean 0.5, centred [.5,-.5,-.5,.5], population std sqrt(4 * .25 / 4) = 0.5
    a = 0.5 / (0.5 + eps)
    # group 2: all equal -> centred 0 -> advantage 0 (not 0/0)
    assert close(adv, [a, -a, -a, a, 0, 0, 0, 0], tol=1e-7)


def test_group_norm_unequal_sizes_and_singletons():
    # [0,0,3]: mean 1, centred [-1,-1,2], var (1+1+4)/3 = 2 -> std sqrt(2) -> [-1/sqrt2, -1/sqrt2, 2/sqrt2]
    # [5]: a group of one -> 0
    adv = group_advantages(torch.tensor([0.0, 0.0, 3.0, 5.0]), [3, 1], norm="group", eps=0.0)
    s = math.sqrt(2.0)
    assert close(adv, [-1 / s, -1 / s, 2 / s, 0.0])
    # equal rewards whose float32 mean is off by an ulp (0.9 * 3 / 3 - 0.9 = 6e-8, and 6e-8 / eps = 0.06)
    # still get exactly 0
    assert group_advantages(torch.tensor([0.9, 0.9, 0.9]), [3], eps=1e-6).abs().max().item() == 0.0
    # all groups flat and eps 0: 0, not 0/0
    assert group_advantages(torch.ones(4), [2, 2], norm="batch", eps=0.0).abs().max().item() == 0.0
    # integer rewards are accepted (cast to float)
    assert close(group_advantages(torch.tensor([1, 0]), [2], eps=0.0), [1.0, -1.0])


def test_batch_and_none_norms():
    # none: r - group mean = [.5,-.5,-.5,.5, 0,0,0,0]
    centred = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    assert close(group_advantages(REWARDS, [4, 4], norm="none", eps=1e-6), centred)
    # batch: std of the centred values over all 8 = sqrt(4 * .25 / 8) = sqrt(1/8) -> .5 / sqrt(1/8) = sqrt(2)
    adv = group_advantages(REWARDS, [4, 4], norm="batch", eps=0.0)
    s = math.sqrt(2.0)
    assert close(adv, [s, -s, -s, s, 0, 0, 0, 0])
    assert close(adv.std(unbiased=False), 1.0)  # unit std over the batch


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="sum to 8"):
        group_advantages(REWARDS, [4, 3])
    with pytest.raises(ValueError, match="positive"):
        group_advantages(REWARDS, [8, 0])
    with pytest.raises(ValueError, match="norm"):
        group_advantages(REWARDS, [4, 4], norm="whiten")


# ---------------------------------------------------------------- KL


def test_kl_estimators_at_points():
    # point 1: p = 0.5, p_ref = 0.25 -> log r = log(p_ref / p) = -ln2, r = 0.5
    #   k1 = ln2 = 0.693147, k2 = ln2^2 / 2 = 0.240227, k3 = (0.5 - 1) + ln2 = 0.193147
    # point 2: p = 0.25, p_ref = 0.5 -> log r = ln2, r = 2
    #   k1 = -ln2 (negative!), k2 = 0.240227, k3 = (2 - 1) - ln2 = 0.306853
    # point 3: p = p_ref -> all 0
    logp = torch.log(torch.tensor([0.5, 0.25, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.3]))
    assert close(kl_estimate(logp, ref, "k1"), [LN2, -LN2, 0.0])
    assert close(kl_estimate(logp, ref, "k2"), [0.5 * LN2**2, 0.5 * LN2**2, 0.0])
    assert close(kl_estimate(logp, ref, "k3"), [LN2 - 0.5, 1 - LN2, 0.0])
    # k3 >= 0 everywhere (r - 1 >= log r)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_estimate(a, b, "k3") >= 0).all()
    with pytest.raises(ValueError, match="estimator"):
        kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_in_expectation():
    # p = [.5,.25,.25], p_ref = [.25,.5,.25]: KL(p || p_ref) = .5 ln2 + .25 ln(1/2) + 0 = .25 ln2.
    # The expectation under p is a p-weighted mean: a float loss_mask of weights p does it exactly.
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([0.25, 0.5, 0.25])
    for est in ("k1", "k3"):
        assert close(kl_loss(p.log(), q.log(), p, est), 0.25 * LN2)
    # k2 is biased: E = .5 * (.5 ln2^2 + .25 ln2^2) = .375 ln2^2 = 0.18017 != 0.17329
    assert close(kl_loss(p.log(), q.log(), p, "k2"), 0.375 * LN2**2)


def test_kl_loss_masking_and_gradient():
    logp = torch.tensor([0.0, math.log(0.5), math.log(0.25)], requires_grad=True)
    # position 0 is a prompt token holding garbage: it must change neither the loss nor the grads
    ref = torch.tensor([-1e4, math.log(0.25), math.log(0.5)])
    mask = torch.tensor([False, True, True])
    loss = kl_loss(logp, ref, mask, "k3")
    assert close(loss, ((LN2 - 0.5) + (1 - LN2)) / 2)  # mean of k3 at the two points above = 0.25
    loss.backward()
    # d k3 / d logp = 1 - r (r = p_ref / p): 1 - 0.5 = 0.5 and 1 - 2 = -1; mean over 2 tokens
    assert torch.isfinite(logp.grad).all()
    assert close(logp.grad, [0.0, 0.25, -0.5])


# ---------------------------------------------------------------- clipped surrogate

OLD = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0])
RATIOS = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1])
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])


def _logp(ratios, old):
    return (old + ratios.log()).clone().requires_grad_(True)


def test_clipped_surrogate_values_stats_and_gradient():
    # eps 0.2, per token L = max(-A r, -A clip(r, .8, 1.2)):
    #   r 1.5, A +1: max(-1.5, -1.2) = -1.2  clipped (gradient 0)
    #   r 0.5, A +1: max(-0.5, -0.8) = -0.5  not clipped (below the range but A > 0: keep pushing)
    #   r 1.5, A -1: max( 1.5,  1.2) =  1.5  not clipped
    #   r 0.5, A -1: max( 0.5,  0.8) =  0.8  clipped (gradient 0)
    #   r 1.1, A +1: max(-1.1, -1.1) = -1.1  inside the range: not clipped
    # loss = (-1.2 - 0.5 + 1.5 + 0.8 - 1.1) / 5 = -0.5 / 5 = -0.1; clipfrac = 2/5
    logp = _logp(RATIOS, OLD)
    loss, stats = ppo_actor_loss(logp, OLD, ADV, torch.ones(5), eps_clip=0.2)
    assert close(loss, -0.1)
    assert close(stats["pg_loss"], -0.1)
    assert close(stats["clipfrac"], 0.4)
    assert close(stats["ratio_mean"], (1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5)  # 1.02
    assert close(stats["ratio_max"], 1.5)
    # approx_kl = mean((r - 1) - log r): r 1.5 -> .5 - .405465 = .094535; r .5 -> -.5 + .693147 = .193147;
    # r 1.1 -> .1 - .095310 = .004690; (2 * .094535 + 2 * .193147 + .004690) / 5 = .116011
    assert close(stats["approx_kl"], (2 * (0.5 - math.log(1.5)) + 2 * (LN2 - 0.5) + (0.1 - math.log(1.1))) / 5)
    assert all(not v.requires_grad for v in stats.values())
    loss.backward()
    # unclipped: d(-r A)/d logp = -r A (dr/dlogp = r), over n = 5 tokens; clipped: 0
    #   [0, -0.5/5, +1.5/5, 0, -1.1/5] = [0, -0.1, 0.3, 0, -0.22]
    assert close(logp.grad, [0.0, -0.1, 0.3, 0.0, -0.22])


def test_dual_clip():
    # eps 0.2, c_clip 3; dual clip bounds L by -c A = 3 |A| when A < 0:
    #   r 5, A -1: max(5, 1.2) = 5  -> min(5, 3) = 3 (dual-clipped, gradient 0)
    #   r 2, A -1: max(2, 1.2) = 2  -> min(2, 3) = 2 (gradient -r A / n = 2/4)
    #   r 5, A -2: max(10, 2.4) = 10 -> min(10, 6) = 6 (dual-clipped)
    #   r 5, A +1: max(-5, -1.2) = -1.2, A > 0: dual clip does not apply (ordinary clip)
    old = torch.zeros(4)
    ratios = torch.tensor([5.0, 2.0, 5.0, 5.0])
    adv = torch.tensor([-1.0, -1.0, -2.0, 1.0])
    plain, _ = ppo_actor_loss(_logp(ratios, old), old, adv, torch.ones(4), eps_clip=0.2)
    assert close(plain, (5 + 2 + 10 - 1.2) / 4)
    logp = _logp(ratios, old)
    loss, stats = ppo_actor_loss(logp, old, adv, torch.ones(4), eps_clip=0.2, c_clip=3.0)
    assert close(loss, (3 + 2 + 6 - 1.2) / 4)
    assert close(stats["dual_clipfrac"], 2 / 4)
    assert close(stats["clipfrac"], 1 / 4)  # only the A > 0 token took the eps-clipped term
    loss.backward()
    assert close(logp.grad, [0.0, 0.5, 0.0, 0.0])


def test_masked_tokens_change_nothing():
    logp = _logp(RATIOS, OLD)
    ref_loss, ref_stats = ppo_actor_loss(logp, OLD, ADV, torch.ones(5), eps_clip=0.2)
    ref_loss.backward()
    ref_grad = logp.grad.clone()
    # Add 3 masked tokens with garbage: a ratio of exp(1e4) and advantages of 1e6.
    old = torch.cat([OLD, torch.tensor([-1e4, 0.0, 0.0])])
    adv = torch.cat([ADV, torch.tensor([1e6, -1e6, 1e6])])
    for mask in (
        torch.tensor([1, 1, 1, 1, 1, 0, 0, 0]),  # int64, as the generate MFC writes it
        torch.tensor([1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool),
        torch.tensor([1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.float32),
    ):
        logp2 = torch.cat([OLD + RATIOS.log(), torch.tensor([0.0, 5.0, -5.0])]).requires_grad_(True)
        loss, stats = ppo_actor_loss(logp2, old, adv, mask, eps_clip=0.2)
        assert close(loss, ref_loss)
        for k in ref_stats:
            assert close(stats[k], ref_stats[k]), k
        loss.backward()
        assert close(logp2.grad, torch.cat([ref_grad, torch.zeros(3)]))


def test_decoupled_weights_and_cap():
    # token 1: behav p .5, prox p .6, new p .9 -> w = .6/.5 = 1.2, r = .9/.6 = 1.5, A +1
    #          L = max(-1.5, -1.2) * 1.2 = -1.44 (clipped vs prox)
    # token 2: behav p .2, prox p .8, new p .8 -> w = 4, r = 1, A +1: L = -1 * 4 = -4 (gradient -w r A / n)
    # token 3: prompt token (mask 0) whose prox - behav is huge (w = inf): must not produce nan
    old = torch.tensor([0.5, 0.2, 1.0]).log()
    old[2] = -1e4
    prox = torch.tensor([0.6, 0.8, 1.0]).log()
    new = torch.tensor([0.9, 0.8, 1.0]).log()
    adv = torch.tensor([1.0, 1.0, 1.0])
    mask = torch.tensor([1.0, 1.0, 0.0])

    logp = new.clone().requires_grad_(True)
    loss, stats = ppo_actor_loss(logp, old, adv, mask, eps_clip=0.2, prox_logprobs=prox)
    assert close(loss, (-1.44 - 4.0) / 2)  # -2.72
    assert close(stats["ratio_mean"], (1.5 + 1.0) / 2)  # the ratio is against prox
    assert close(stats["behav_imp_weight_mean"], (1.2 + 4.0) / 2)
    assert close(stats["behav_mask_frac"], 0.0)
    assert close(stats["clipfrac"], 0.5)
    loss.backward()
    assert close(logp.grad, [0.0, -4.0 / 2, 0.0])

    # cap 2: token 2 (w = 4) is dropped but still counts in the denominator (AReaL): -1.44 / 2
    logp = new.clone().requires_grad_(True)
    loss, stats = ppo_actor_loss(logp, old, adv, mask, eps_clip=0.2, prox_logprobs=prox, behav_imp_weight_cap=2.0)
    assert close(loss, -1.44 / 2)
    assert close(stats["behav_mask_frac"], 0.5)
    assert close(stats["behav_imp_weight_mean"], 1.2)  # over the kept tokens
    assert close(stats["ratio_mean"], 1.5)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert close(logp.grad, [0.0, 0.0, 0.0])  # token 1 clipped, token 2 dropped

    # a loss-token whose weight overflows to inf, dropped by the cap: no nan in loss or grads
    old_inf = old.clone()
    old_inf[1] = -1e4
    logp = new.clone().requires_grad_(True)
    loss, _ = ppo_actor_loss(logp, old_inf, adv, mask, eps_clip=0.2, prox_logprobs=prox, behav_imp_weight_cap=2.0)
    loss.backward()
    assert close(loss, -1.44 / 2) and torch.isfinite(logp.grad).all()


def test_ppo_actor_loss_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="eps_clip"):
        ppo_actor_loss(x, x, x, x, eps_clip=0.0)
    with pytest.raises(ValueError, match="c_clip"):
        ppo_actor_loss(x, x, x, x, eps_clip=0.2, c_clip=1.0)
    with pytest.raises(ValueError, match="prox_logprobs"):
        ppo_actor_loss(x, x, x, x, eps_clip=0.2, behav_imp_weight_cap=5.0)
    with pytest.raises(ValueError, match="one shape"):
        ppo_actor_loss(x, torch.zeros(4), x, x, eps_clip=0.2)
    with pytest.raises(ValueError, match="loss_mask"):
        ppo_actor_loss(x, x, x, torch.ones(4), eps_clip=0.2)


# ---------------------------------------------------------------- SFT


def test_sft_loss():
    # response tokens of p .5 and .25: nll = (ln2 + 2 ln2) / 2 = 1.5 ln2 = 1.039721;
    # ppl = exp(nll) = 2^1.5 = 2.828427 (geometric mean of 1/p = sqrt(2 * 4))
    logp = torch.tensor([0.0, math.log(0.5), math.log(0.25), -100.0], requires_grad=True)
    loss, stats = sft_loss(logp, torch.tensor([0, 1, 1, 0]))
    assert close(loss, 1.5 * LN2) and close(stats["nll"], 1.5 * LN2)
    assert close(stats["ppl"], 2**1.5)
    loss.backward()
    assert close(logp.grad, [0.0, -0.5, -0.5, 0.0])  # d(-mean logp)/d logp = -1/n on the mask


def test_entropy_bonus_lowers_the_loss_by_coef_times_the_mean_response_entropy():
    from realcore.api.config import PPOConfig
    from realcore.api.engine import HeadOutput
    from realcore.mfc.train import PPOArgs, PPOUpdate

    def update(coef):
        u = PPOUpdate.__new__(PPOUpdate)
        u.ppo = PPOConfig(entropy_coef=coef)
        u.args, u._gaps = PPOUpdate.resolve(PPOArgs(), u.ppo), None
        return u

    torch.manual_seed(0)
    lp = torch.randn(6)
    data = {"loss_mask": torch.tensor([0, 1, 1, 1, 0, 1]), "behav_logprobs": lp.clone(), "advantages": torch.randn(6)}
    entropy = torch.rand(6, requires_grad=True)
    out = HeadOutput(torch.tensor([0, 4, 6]), logprobs=lp, entropy=entropy)
    plain, _ = update(0.0).loss_fn(out, data)
    bonus, stats = update(0.1).loss_fn(out, data)
    mean = entropy[data["loss_mask"].bool()].mean()
    assert torch.allclose(bonus, plain - 0.1 * mean) and torch.allclose(stats["ppo/entropy"], mean.detach())
    bonus.backward()  # the bonus pushes entropy up on response tokens only
    assert torch.allclose(entropy.grad, -0.1 * data["loss_mask"].float() / 4)
