"""PPO / GRPO math as pure functions of tensors, named as in the papers (see docs/ppo.md).

Every per-token function takes tensors of one shape (usually the flat (n_tokens,) of a packed
micro-batch) and a `loss_mask` (bool, int or float; a float mask weights tokens). Losses are
token-level means over the mask; stats are detached scalar tensors (masked means) meant to be
logged next to the loss, cleanrl style.

Token alignment (realcore.api.data): `logprobs[t] = log p(x[t] | x[:t])`, `logprobs[0] = 0`, and
`loss_mask` is 1 on the response tokens, so every per-token key lines up position by position.
Log-probs are those of the temperature-scaled logits, in generation and in training alike.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AdvNorm = Literal["group", "batch", "none"]
KLEstimator = Literal["k1", "k2", "k3"]


def _float_mask(mask: Tensor, like: Tensor) -> Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"loss_mask has shape {tuple(mask.shape)} but the tensors have {tuple(like.shape)}")
    return mask.to(like.dtype if like.is_floating_point() else torch.float32)


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must share one shape, got {shapes}")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) / sum(mask) over `dim` (all dims if None); 0 where the mask is empty.
    Masked-out entries are replaced by 0 first, so inf/nan there cannot leak into the result."""
    m = _float_mask(mask, x)
    xm = torch.where(m != 0, x, torch.zeros_like(x)) * m
    if dim is None:
        return xm.sum() / m.sum().clamp(min=1e-8)
    return xm.sum(dim) / m.sum(dim).clamp(min=1e-8)


def group_advantages(rewards: Tensor, group_sizes: list[int], *, norm: AdvNorm = "group", eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath eq. 3), one per sequence.

    rewards: (N,), the sequences of each group consecutive; group_sizes: sizes summing to N.
      norm="group": A_i = (r_i - mean(r_g)) / (std(r_g) + eps)          (GRPO)
      norm="batch": A_i = (r_i - mean(r_g)) / (std over the batch of those centred values + eps)
      norm="none":  A_i =  r_i - mean(r_g)                               (Dr. GRPO, Liu et al. 2025)
    std is the population std (unbiased=False): it is defined for every group size, and a
    group of one (or of equal rewards) gets advantage exactly 0 instead of 0/0 or a blown-up
    1/eps. "batch" divides by the std of the centred rewards, so the batch's advantages have
    unit std; groups with equal rewards add zeros to it (and keep advantage 0).
    """
    if norm not in ("group", "batch", "none"):
        raise ValueError(f"norm must be 'group', 'batch' or 'none', got {norm!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if any(g <= 0 for g in group_sizes) or sum(group_sizes) != rewards.numel():
        raise ValueError(f"group_sizes {group_sizes} must be positive and sum to {rewards.numel()} rewards")
    r = rewards.float() if not rewards.is_floating_point() else rewards
    if r.numel() == 0:
        return r.clone()
    sizes = torch.tensor(group_sizes, dtype=r.dtype, device=r.device)  # (G,)
    gid = torch.repeat_interleave(torch.arange(len(group_sizes), device=r.device), sizes.long())  # (N,)
    mean = torch.zeros_like(sizes).index_add_(0, gid, r) / sizes  # (G,)
    # A group whose rewards are all equal (or of size 1) carries no signal: exactly 0, not the
    # rounding error of its mean divided by eps.
    gmax = torch.full_like(sizes, -torch.inf).scatter_reduce(0, gid, r, "amax")  # (G,)
    gmin = torch.full_like(sizes, torch.inf).scatter_reduce(0, gid, r, "amin")  # (G,)
    flat = (gmax == gmin)[gid]  # (N,)
    centred = torch.where(flat, torch.zeros_like(r), r - mean[gid])  # (N,)
    if norm == "none":
        return centred
    if norm == "group":
        std = (torch.zeros_like(sizes).index_add_(0, gid, centred**2) / sizes).sqrt()  # (G,)
        return torch.where(flat, torch.zeros_like(r), centred / (std[gid] + eps))
    return torch.where(flat, torch.zeros_like(r), centred / (centred.std(unbiased=False) + eps))


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman 2020,
    "Approximating KL divergence"), with log r = ref_logp - logp:
      k1 = -log r = logp - ref_logp            unbiased, high variance, can be negative
      k2 = (log r)^2 / 2                        biased, low variance, >= 0
      k3 = (r - 1) - log r                      unbiased, low variance, >= 0
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Masked token mean of `kl_estimate`: the term weighted by `kl_coef` in the PPO loss
    (GRPO puts it in the loss rather than in the reward, DeepSeekMath eq. 3-4)."""
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    m = _float_mask(loss_mask, logprobs)
    # Zero the log-ratio off the mask so exp() of garbage (e.g. prompt tokens) cannot overflow.
    ref = torch.where(m != 0, ref_logprobs, logprobs.detach())
    return masked_mean(kl_estimate(logprobs, ref, estimator), m)


def ppo_actor_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_clip: float,
    c_clip: float | None = None,
    prox_logprobs: Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level clipped surrogate (Schulman et al. 2017, eq. 7), as a loss to minimise:

        r_t = exp(logprobs_t - old_logprobs_t)
        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip, 1 + eps_clip))      (= -min(...) of eq. 7)
        loss = sum_t mask_t L_t / sum_t mask_t

    Dual clip (Ye et al. 2020), when `c_clip` (> 1) is given: for A_t < 0 the loss is also
    bounded above, L_t = min(L_t, -c_clip A_t), so a huge ratio on a bad token cannot produce an
    unbounded (and zero-clipping) update; tokens with A_t >= 0 are unchanged.

    Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025), when `prox_logprobs` is given:
    `old_logprobs` are the behaviour policy's (the one that sampled, maybe several versions stale),
    the trust region is around the proximal policy: r_t = exp(logprobs_t - prox_logprobs_t), and
    each L_t is multiplied by the behaviour importance weight w_t = exp(prox_t - old_t). Tokens with
    w_t > `behav_imp_weight_cap` contribute 0 but keep their place in the denominator (as AReaL),
    so the loss stays a mean over the micro-batch's loss tokens, as the engine's token weighting
    (`LossWeightFn`) assumes.

    old_logprobs, prox_logprobs and advantages are constants (detached). Returns (loss, stats):
      pg_loss       the loss (detached)
      clipfrac      fraction of tokens whose loss took the clipped term (clipping active)
      dual_clipfrac fraction of tokens bounded by the dual clip (only with c_clip)
      approx_kl     k3 estimate of KL(pi_old || pi) = mean((r - 1) - log r) (cleanrl), r the
                    clipped ratio (vs prox in decoupled mode): how far the update has moved
      ratio_mean, ratio_max
      behav_imp_weight_mean  mean w_t over the tokens kept (decoupled only)
      behav_mask_frac        fraction of loss tokens dropped by the cap (decoupled only)
    Clipping stats are over the tokens that contribute to the loss.
    """
    if eps_clip <= 0:
        raise ValueError(f"eps_clip must be > 0, got {eps_clip}")
    if c_clip is not None and c_clip <= 1:
        raise ValueError(f"c_clip must be > 1 (dual clip), got {c_clip}")
    if behav_imp_weight_cap is not None and prox_logprobs is None:
        raise ValueError("behav_imp_weight_cap needs prox_logprobs (decoupled PPO)")
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    mask = _float_mask(loss_mask, logprobs)
    on = mask != 0
    A = advantages.detach().to(logprobs.dtype)
    old = old_logprobs.detach()
    base = old if prox_logprobs is None else prox_logprobs.detach()
    if prox_logprobs is not None:
        _check_same_shape(logprobs=logprobs, prox_logprobs=prox_logprobs)

    # Zero the log-ratio off the mask: prompt tokens may hold arbitrary values, and exp() of a
    # large one would overflow (inf * 0 = nan in the backward pass).
    logratio = torch.where(on, logprobs - base, torch.zeros_like(logprobs))
    ratio = logratio.exp()
    pg_loss1 = -A * ratio
    pg_loss2 = -A * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)
    clipped = pg_loss2 > pg_loss1
    if c_clip is not None:
        pg_loss3 = -c_clip * A
        dual = (A < 0) & (pg_loss3 < pg_loss)
        pg_loss = torch.where(A < 0, torch.minimum(pg_loss, pg_loss3), pg_loss)

    keep = mask  # the tokens that contribute (cap-dropped tokens removed)
    if prox_logprobs is not None:
        behav_logw = torch.where(on, base - old, torch.zeros_like(base))
        behav_w = behav_logw.exp()
        if behav_imp_weight_cap is not None:
            keep = mask * (behav_w <= behav_imp_weight_cap).to(mask.dtype)
        # where, not a product: a dropped token's weight may be inf, and inf * 0 = nan.
        pg_loss = pg_loss * torch.where(keep != 0, behav_w, torch.zeros_like(behav_w))

    # Denominator: all loss tokens (not only the kept ones), see the docstring.
    loss = (torch.where(on, pg_loss, torch.zeros_like(pg_loss)) * mask).sum() / mask.sum().clamp(min=1e-8)

    with torch.no_grad():
        kept = keep != 0
        stats = {
            "pg_loss": loss.detach(),
            "clipfrac": masked_mean(clipped.to(mask.dtype), keep),
            "approx_kl": masked_mean(torch.expm1(logratio) - logratio, keep),
            "ratio_mean": masked_mean(ratio, keep),
            "ratio_max": torch.where(kept, ratio, torch.zeros_like(ratio)).max() if ratio.numel() else ratio.new_zeros(()),
        }
        if c_clip is not None:
            stats["dual_clipfrac"] = masked_mean(dual.to(mask.dtype), keep)
        if prox_logprobs is not None:
            stats["behav_imp_weight_mean"] = masked_mean(behav_w, keep)
            stats["behav_mask_frac"] = masked_mean((~kept).to(mask.dtype), mask)
    return loss, stats


def sft_loss(logprobs: Tensor, loss_mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level negative log-likelihood on the mask; stats `nll` and `ppl` = exp(nll)."""
    loss = masked_mean(-logprobs, loss_mask)
    nll = loss.detach()
    return loss, {"nll": nll, "ppl": nll.exp()}
