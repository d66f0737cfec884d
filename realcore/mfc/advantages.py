"""Advantage estimators registered by name (realcore.api.algorithms), and DAPO's overlong shaping.

Each estimator is a pure function `fn(AdvantageInputs) -> AdvantageOutputs` over one data-parallel
rank's batch: advantages per sequence, 0 off the sequence's loss mask. Outcome estimators compute one
number per sequence and broadcast it on that sequence's loss-mask tokens. "Batch" statistics are
those of the rank's batch. GAE lives in realcore/mfc/gae.py (the critic's). Sources: docs/ppo.md.
torch is imported inside the functions: the master registers them (and checks names) without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from realcore.api.algorithms import AdvantageInputs, AdvantageOutputs, register_advantage

if TYPE_CHECKING:
    from torch import Tensor


def _arg(inputs: AdvantageInputs, name: str, default):
    """An estimator's setting from the update's args (None or absent: the default)."""
    v = getattr(inputs.args, name, None) if inputs.args is not None else None
    return default if v is None else v


def broadcast(per_seq: Tensor, loss_mask: list[Tensor]) -> list[Tensor]:
    """One value per sequence -> that value on the sequence's loss-mask tokens, 0 elsewhere."""
    import torch

    return [torch.where(m.bool(), a.to(torch.float32), torch.zeros((), dtype=torch.float32))
            for a, m in zip(per_seq.float(), loss_mask)]


def _outcome(inputs: AdvantageInputs, per_seq: Tensor) -> AdvantageOutputs:
    return AdvantageOutputs(broadcast(per_seq, inputs.loss_mask))


@register_advantage("grpo")
def grpo(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GRPO (Shao et al. 2024, DeepSeekMath eq. 3 with outcome supervision): A_i = (r_i - mean_g) / (std_g + eps),
    the population std; `adv_norm: batch` divides by the batch std instead, `none` by nothing."""
    from realcore.mfc.ppo_functional import group_advantages  # torch: see the module's docstring

    a = group_advantages(inputs.rewards, inputs.group_sizes, norm=_arg(inputs, "adv_norm", "group"),
                         eps=_arg(inputs, "adv_eps", 1e-6))
    return _outcome(inputs, a)


@register_advantage("dr-grpo")
def dr_grpo(inputs: AdvantageInputs) -> AdvantageOutputs:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training", §3.1): A_i = r_i - mean_g, not
    divided by the std (which up-weights near-unanimous groups)."""
    from realcore.mfc.ppo_functional import group_advantages  # torch

    return _outcome(inputs, group_advantages(inputs.rewards, inputs.group_sizes, norm="none"))


def _group_ids(group_sizes: list[int], n: int) -> Tensor:
    import torch

    if any(g <= 0 for g in group_sizes) or sum(group_sizes) != n:
        raise ValueError(f"group_sizes {group_sizes} must be positive and sum to {n} rewards")
    return torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(group_sizes, dtype=torch.long))


@register_advantage("rloo")
def rloo(inputs: AdvantageInputs) -> AdvantageOutputs:
    """RLOO (Ahmadian et al. 2024, "Back to basics", §3; Kool et al. 2019): the baseline of sample i is the
    mean reward of the other k-1 samples of its prompt, A_i = r_i - (sum_g - r_i) / (k - 1). A group of one
    has no other sample: advantage 0."""
    import torch

    r = inputs.rewards.float()
    gid = _group_ids(inputs.group_sizes, r.numel())
    k = torch.tensor(inputs.group_sizes, dtype=torch.float32)[gid]  # (N,)
    total = torch.zeros(len(inputs.group_sizes)).index_add_(0, gid, r)[gid]  # (N,)
    a = torch.where(k > 1, r - (total - r) / (k - 1).clamp(min=1), torch.zeros_like(r))
    return _outcome(inputs, a)


def returns_to_go(token_rewards: list[Tensor], loss_mask: list[Tensor], gamma: float) -> list[Tensor]:
    """G_t = r_t + gamma G_t' over each sequence's response tokens, t' the next response token (the discount
    counts response tokens only: a tool's observation between turns is no action); 0 off the mask."""
    import torch

    out = []
    for r, m in zip(token_rewards, loss_mask):
        on = m.bool()
        rs = r[on].double().tolist()  # the response tokens in order; plain floats: a loop over tensors is slow
        acc, g = 0.0, [0.0] * len(rs)
        for t in range(len(rs) - 1, -1, -1):
            acc = rs[t] + gamma * acc
            g[t] = acc
        full = torch.zeros(len(r), dtype=torch.float32)
        full[on] = torch.tensor(g, dtype=torch.float32)
        out.append(full)
    return out


def _token_rewards(inputs: AdvantageInputs, outcome: Tensor) -> list[Tensor]:
    """The per-token rewards (e.g. -kl_in_reward x KL) plus the outcome on each sequence's last response token."""
    import torch

    base = inputs.token_rewards or [torch.zeros(len(m)) for m in inputs.loss_mask]
    out = []
    for r, m, o in zip(base, inputs.loss_mask, outcome.float()):
        r = torch.where(m.bool(), r.float(), torch.zeros((), dtype=torch.float32)).clone()
        idx = m.nonzero()
        if len(idx):
            r[int(idx[-1])] += o
        out.append(r)
    return out


def _whiten(values: list[Tensor], loss_mask: list[Tensor], eps: float) -> list[Tensor]:
    """(x - mean) / (std + eps) with mean and population std over every loss-mask token of the batch."""
    import torch

    on = torch.cat([m.bool() for m in loss_mask]) if loss_mask else torch.zeros(0, dtype=torch.bool)
    x = torch.cat(values)[on] if values else torch.zeros(0)
    if x.numel() == 0:
        return [torch.zeros_like(v) for v in values]
    if bool(x.max() == x.min()):  # equal values carry no signal: exactly 0, not rounding error / eps
        return [torch.zeros_like(v) for v in values]
    mean, std = x.mean(), x.std(unbiased=False)
    return [torch.where(m.bool(), (v - mean) / (std + eps), torch.zeros_like(v)) for v, m in zip(values, loss_mask)]


def _reinforce_pp(inputs: AdvantageInputs, outcome: Tensor) -> AdvantageOutputs:
    import torch

    g = returns_to_go(_token_rewards(inputs, outcome), inputs.loss_mask, float(_arg(inputs, "gamma", 1.0)))
    adv = _whiten(g, inputs.loss_mask, float(_arg(inputs, "adv_eps", 1e-6)))
    on = torch.cat([m.bool() for m in inputs.loss_mask]) if inputs.loss_mask else torch.zeros(0, dtype=torch.bool)
    flat = torch.cat(g)[on] if inputs.loss_mask else torch.zeros(0)
    return AdvantageOutputs(adv, None, {"return_mean": float(flat.mean()) if flat.numel() else 0.0})


@register_advantage("reinforce++")
def reinforce_pp(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, §3): token reward r_t = -beta KL_t (+ the outcome on the last
    response token), A_t = sum_{k >= t} gamma^(k-t) r_k, normalised over the batch's tokens: (A - mean) / (std + eps)."""
    return _reinforce_pp(inputs, inputs.rewards)


@register_advantage("reinforce++-baseline")
def reinforce_pp_baseline(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++-baseline (Hu 2025, §3; OpenRLHF's `reinforce_baseline`): the outcome minus its group's mean
    reward, then REINFORCE++'s return-to-go with the token rewards and batch normalisation."""
    from realcore.mfc.ppo_functional import group_advantages  # torch

    centred = group_advantages(inputs.rewards, inputs.group_sizes, norm="none")
    return _reinforce_pp(inputs, centred)


def overlong_penalty(response_lengths: Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward:
        0                               if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                              if |y| > L_max
    with L_max = max_new_tokens, L_cache = buffer, times `factor`."""
    import torch

    if buffer <= 0 or buffer > max_new_tokens:
        raise ValueError(f"overlong_buffer must be in [1, max_new_tokens={max_new_tokens}], got {buffer}")
    n = response_lengths.float()
    soft = max_new_tokens - buffer
    pen = torch.where(n <= soft, torch.zeros_like(n), (soft - n) / buffer)
    return factor * torch.where(n > max_new_tokens, -torch.ones_like(n), pen)
