"""Policy losses registered by name (realcore.api.algorithms), their aggregation, and the off-policy
corrections against engine mismatch.

A loss is `fn(PolicyLossInputs) -> (per-token loss (n_tokens,), stats)` on one packed micro-batch; the
update multiplies the per-token loss by the correction weights and reduces it with `aggregate`. Every
ratio is taken against `old_logprobs` with the log-ratio zeroed off the mask first (a prompt token may
hold anything, and exp() of it could overflow). Sources and equations: docs/ppo.md.
torch is imported inside the functions: the master registers them (and checks names) without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from realcore.api.algorithms import PolicyLossInputs, register_policy_loss

if TYPE_CHECKING:
    from torch import Tensor

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def _arg(inputs: PolicyLossInputs, name: str, default):
    """A loss's setting from the update's args (None or absent: the default)."""
    v = getattr(inputs.args, name, None) if inputs.args is not None else None
    return default if v is None else v


def _log_ratio(inputs: PolicyLossInputs) -> tuple[Tensor, Tensor]:
    """(log-ratio, float mask): log pi - log pi_old on the mask, 0 off it."""
    import torch

    mask = inputs.loss_mask.to(inputs.logprobs.dtype)
    on = mask != 0
    lr = torch.where(on, inputs.logprobs - inputs.old_logprobs.detach(), torch.zeros_like(inputs.logprobs))
    return lr, mask


def _ratio_stats(ratio: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    import torch

    from realcore.mfc.ppo_functional import masked_mean

    on = mask != 0
    return {
        "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),  # k3 of KL(pi_old || pi), cleanrl
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": torch.where(on, ratio, torch.zeros_like(ratio)).max() if ratio.numel() else ratio.new_zeros(()),
    }


def _clip_bounds(inputs: PolicyLossInputs) -> tuple[float, float]:
    low = float(_arg(inputs, "eps_clip", 0.2))
    return low, float(_arg(inputs, "eps_clip_high", low))


@register_policy_loss("ppo-clip")
def ppo_clip(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) per token, as a loss:
        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    eps_low = `eps_clip`, eps_high = `eps_clip_high` (DAPO's clip-higher, Yu et al. 2025 §3.1; default
    eps_clip). Dual clip (Ye et al. 2020) with `c_clip` > 1: for A_t < 0, L_t = min(L_t, -c_clip A_t)."""
    import torch

    from realcore.mfc.ppo_functional import masked_mean

    lr, mask = _log_ratio(inputs)
    low, high = _clip_bounds(inputs)
    A = inputs.advantages.detach().to(lr.dtype)
    ratio = lr.exp()
    loss1 = -A * ratio
    loss2 = -A * ratio.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(loss1, loss2)
    c_clip = _arg(inputs, "c_clip", None)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((loss2 > loss1).to(mask.dtype), mask), **_ratio_stats(ratio, lr, mask)}
    if c_clip is not None:
        loss3 = -float(c_clip) * A
        with torch.no_grad():
            stats["dual_clipfrac"] = masked_mean(((A < 0) & (loss3 < loss)).to(mask.dtype), mask)
        loss = torch.where(A < 0, torch.minimum(loss, loss3), loss)
    return loss, stats


def seq_mean_log_ratio(log_ratio: Tensor, mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per token: the mean of the log-ratio over its sequence's loss tokens (0 for a sequence without any)."""
    import torch

    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sid = torch.repeat_interleave(torch.arange(len(lens), device=log_ratio.device), lens)  # (n_tokens,)
    n = torch.zeros(len(lens), dtype=mask.dtype, device=mask.device).index_add_(0, sid, mask)
    s = torch.zeros(len(lens), dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, sid, log_ratio * mask)
    return (s / n.clamp(min=1))[sid]


@register_policy_loss("gspo")
def gspo(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, §4.1): the sequence-level ratio s_i = exp(mean_t log(pi / pi_old)) over the
    sequence's tokens, clipped per sequence to [1 - eps_clip, 1 + eps_clip_high]. Per token (GSPO-token, §4.3):
    s_i,t = sg(s_i) pi_t / sg(pi_t), equal to s_i in value and whose gradient, averaged over the sequence's tokens
    (loss_agg seq-mean-token-mean), is that of s_i A_i."""
    import torch

    from realcore.mfc.ppo_functional import masked_mean

    lr, mask = _log_ratio(inputs)
    seq_lr = seq_mean_log_ratio(lr.detach(), mask, inputs.cu_seqlens)
    # the log of s_i,t: value mean log-ratio of the sequence, gradient d log pi_t
    log_s = torch.where(mask != 0, seq_lr + inputs.logprobs - inputs.logprobs.detach(), torch.zeros_like(lr))
    s = log_s.exp()
    low, high = _clip_bounds(inputs)
    A = inputs.advantages.detach().to(lr.dtype)
    loss1 = -A * s
    loss2 = -A * s.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(loss1, loss2)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((loss2 > loss1).to(mask.dtype), mask), **_ratio_stats(lr.exp(), lr, mask),
                 "seq_ratio_mean": masked_mean(s, mask)}
    return loss, stats


@register_policy_loss("cispo")
def cispo(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025, §3.1): the importance weight is clipped and its gradient stopped, and every
    token keeps a policy-gradient term: L_t = -sg(clip(r_t, 1 - eps_clip, 1 + eps_clip_high)) A_t log pi_t."""
    import torch

    from realcore.mfc.ppo_functional import masked_mean

    lr, mask = _log_ratio(inputs)
    low, high = _clip_bounds(inputs)
    ratio = lr.exp()
    w = ratio.detach().clamp(1.0 - low, 1.0 + high)
    A = inputs.advantages.detach().to(lr.dtype)
    logp = torch.where(mask != 0, inputs.logprobs, torch.zeros_like(inputs.logprobs))
    loss = -w * A * logp
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((w != ratio).to(mask.dtype), mask), **_ratio_stats(ratio, lr, mask)}
    return loss, stats


@register_policy_loss("sapo")
def sapo(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347, the SAPO objective): a smooth
    gate instead of the hard clip, L_t = -f(r_t) A_t with f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = sapo_tau_pos
    when A_t > 0 else sapo_tau_neg; its gradient weight 4 sigmoid (1 - sigmoid) is 1 at r = 1 and decays
    smoothly off-policy (faster for negative advantages, tau_neg > tau_pos)."""
    import torch

    lr, mask = _log_ratio(inputs)
    ratio = lr.exp()
    A = inputs.advantages.detach().to(lr.dtype)
    tau = torch.where(A > 0, float(_arg(inputs, "sapo_tau_pos", 1.0)), float(_arg(inputs, "sapo_tau_neg", 1.05)))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * A
    with torch.no_grad():
        stats = _ratio_stats(ratio, lr, mask)
    return loss, stats


def aggregate(loss: Tensor, mask: Tensor, cu_seqlens: Tensor, mode: LossAgg = "token-mean") -> Tensor:
    """Reduce a per-token loss over the mask (verl's `agg_loss` names; Dr. GRPO, Liu et al. 2025, §3.1):
      token-mean           sum_t m_t L_t / sum_t m_t                     (DAPO's token-level loss)
      seq-mean-token-sum   mean over sequences of sum_t m_t L_t
      seq-mean-token-mean  mean over sequences of (sum_t m_t L_t / sum_t m_t)   (GRPO as published)
    Sequences without loss tokens are left out of the sequence means; masked-out entries (even inf/nan) add 0."""
    import torch

    m = mask.to(loss.dtype)
    lm = torch.where(m != 0, loss, torch.zeros_like(loss)) * m
    if mode == "token-mean":
        return lm.sum() / m.sum().clamp(min=1e-8)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sid = torch.repeat_interleave(torch.arange(len(lens), device=loss.device), lens)
    per_seq = torch.zeros(len(lens), dtype=loss.dtype, device=loss.device).index_add(0, sid, lm)
    n_tok = torch.zeros(len(lens), dtype=loss.dtype, device=loss.device).index_add(0, sid, m)
    has = n_tok > 0
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / n_tok.clamp(min=1e-8)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg must be token-mean, seq-mean-token-sum or seq-mean-token-mean, got {mode!r}")
    return torch.where(has, per_seq, torch.zeros_like(per_seq)).sum() / has.sum().clamp(min=1)


def loss_weight(data: dict[str, Tensor], mode: LossAgg = "token-mean") -> float:
    """What `aggregate` averages over in a packed micro-batch (the engine's weight of its mean): loss tokens for
    token-mean, sequences with at least one loss token for the sequence means."""
    mask = data["loss_mask"]
    if mode == "token-mean":
        return float(mask.sum())
    cu = data["cu_seqlens"]
    return float(sum(bool(mask[int(a):int(b)].any()) for a, b in zip(cu[:-1], cu[1:])))


OffPolicy = Literal["none", "tis", "mis"]


def off_policy_weights(behav_logprobs: Tensor, recomputed_logprobs: Tensor, mask: Tensor, mode: OffPolicy,
                       threshold: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights that correct the gap between the sampler's (behaviour) log-probs and the trainer's
    recomputed ones for the same weights, w_t = exp(recomputed_t - behav_t):
      tis  min(w_t, C), C = threshold (truncated IS; Yao et al. 2025, "Your efficient RL framework secretly
           brings you off-policy RL training")
      mis  1 where 1/C <= w_t <= C, else 0: the token is dropped from the loss (masked IS; IcePop, Ling team 2025)
      none 1
    Off the mask: 0. Detached (the weight is a constant of the loss)."""
    import torch

    from realcore.mfc.ppo_functional import masked_mean

    if mode not in ("none", "tis", "mis"):
        raise ValueError(f"off_policy must be none, tis or mis, got {mode!r}")
    if mode != "none" and threshold <= 1:
        raise ValueError(f"off_policy_threshold must be > 1, got {threshold}")
    on = mask != 0
    log_w = torch.where(on, recomputed_logprobs.detach() - behav_logprobs.detach(), torch.zeros_like(behav_logprobs))
    w = log_w.exp()
    if mode == "none":
        out = torch.ones_like(w)
    elif mode == "tis":
        out = w.clamp(max=threshold)
    else:
        out = (log_w.abs() <= torch.log(torch.tensor(threshold, dtype=log_w.dtype))).to(w.dtype)
    out = torch.where(on, out, torch.zeros_like(out))
    fm = mask.to(w.dtype)
    stats = {"off_policy/weight_mean": masked_mean(out, fm),
             "off_policy/raw_weight_mean": masked_mean(w, fm)}
    if mode == "mis":
        stats["off_policy/masked_frac"] = masked_mean((out == 0).to(w.dtype), fm)
    if mode == "tis":
        stats["off_policy/truncated_frac"] = masked_mean((w > threshold).to(w.dtype), fm)
    return out, stats
