"""Generalized advantage estimation (Schulman et al. 2016) and the token rewards of critic PPO;
registered as the advantage estimator `gae` (docs/critic.md).

Sequences are lists of 1-D tensors aligned as in realcore.api.data: `loss_mask[t] = 1` on the
response tokens, `logprobs[t] = log p(x[t] | x[:t])`, and the critic's `values[t] = V(x[:t])`, the
value of the state in which token t is chosen. The MDP's steps are a sequence's response tokens in
order: choosing x[t] earns `token_rewards[t]` and leads to the state of the next response token (a
multi-turn episode's environment tokens, off the mask, are part of that transition); the episode
ends after the last response token, where V = 0. Prompt (off-mask) tokens get advantage and return 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from realcore.api.algorithms import AdvantageInputs, AdvantageOutputs, register_advantage

if TYPE_CHECKING:  # torch is imported in the functions: the master registers `gae` without torch
    from torch import Tensor


def _check(name: str, seqs: list[Tensor], loss_mask: list[Tensor]) -> None:
    if len(seqs) != len(loss_mask):
        raise ValueError(f"{name}: {len(seqs)} sequences but loss_mask has {len(loss_mask)}")
    for i, (x, m) in enumerate(zip(seqs, loss_mask)):
        if x.shape != m.shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(x.shape)} but its loss_mask {tuple(m.shape)}")


def outcome_token_rewards(rewards: Tensor, loss_mask: list[Tensor]) -> list[Tensor]:
    """Each sequence's outcome reward on its last response token, 0 elsewhere (float32, per sequence).
    A sequence without response tokens gets all zeros."""
    import torch  # why: see TYPE_CHECKING above

    if rewards.numel() != len(loss_mask):
        raise ValueError(f"rewards: {rewards.numel()} values for {len(loss_mask)} sequences")
    out = []
    for r, m in zip(rewards.reshape(-1).tolist(), loss_mask):
        t = torch.zeros(m.shape, dtype=torch.float32)
        on = m.nonzero()
        if len(on):
            t[on[-1, 0]] = r
        out.append(t)
    return out


def kl_penalty_rewards(behav_logprobs: list[Tensor], ref_logprobs: list[Tensor], loss_mask: list[Tensor],
                       kl_coef: float) -> list[Tensor]:
    """-kl_coef x (behav - ref) on every response token, 0 elsewhere: the per-token KL reward of
    InstructGPT (Ouyang et al. 2022, eq. 2), estimated by k1 = log pi_behav - log pi_ref on the
    sampled token. What the update hands an estimator as `AdvantageInputs.token_rewards`."""
    _check("behav_logprobs", behav_logprobs, loss_mask)
    _check("ref_logprobs", ref_logprobs, loss_mask)
    return [-kl_coef * (b.float() - r.float()) * m.float() for b, r, m in zip(behav_logprobs, ref_logprobs, loss_mask)]


def kl_token_rewards(rewards: Tensor, behav_logprobs: list[Tensor] | None, ref_logprobs: list[Tensor] | None,
                     loss_mask: list[Tensor], kl_coef: float) -> list[Tensor]:
    """Token rewards of critic PPO (InstructGPT; AReaL's realhf): the outcome reward (n_seqs,) on
    each sequence's last response token plus -kl_coef x (behav - ref) on every response token.
    The log-probs may be None only when kl_coef is 0."""
    out = outcome_token_rewards(rewards, loss_mask)
    if kl_coef == 0:
        return out
    if behav_logprobs is None or ref_logprobs is None:
        raise ValueError(f"kl_coef {kl_coef} > 0 needs behav_logprobs and ref_logprobs")
    return [o + k for o, k in zip(out, kl_penalty_rewards(behav_logprobs, ref_logprobs, loss_mask, kl_coef))]


def gae(token_rewards: list[Tensor], values: list[Tensor], loss_mask: list[Tensor], gamma: float,
        lam: float) -> tuple[list[Tensor], list[Tensor]]:
    """GAE(gamma, lambda) of each sequence (Schulman et al. 2016, eq. 16), over its response tokens
    t_1 < ... < t_n (the module docstring's MDP):

        delta_k = r[t_k] + gamma V[t_{k+1}] - V[t_k]        (V[t_{n+1}] = 0: the episode has ended)
        A[t_k]  = sum_{l >= 0} (gamma lam)^l delta_{k+l}     (computed as A_k = delta_k + gamma lam A_{k+1})
        R[t_k]  = A[t_k] + V[t_k]                            (the critic's target, the lambda-return)

    Returns (advantages, returns) per sequence, float32, 0 off the mask."""
    import torch  # why: see TYPE_CHECKING above

    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gae: gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    _check("token_rewards", token_rewards, loss_mask)
    _check("values", values, loss_mask)
    idx = [m.nonzero()[:, 0] for m in loss_mask]
    n = len(idx)
    T = max((len(i) for i in idx), default=0)
    # Response tokens of every sequence, left-aligned and zero-padded: (n, T). The padding after a
    # sequence's last response token has r = V = 0, hence delta = A = 0: the terminal state's V = 0.
    r = torch.zeros(n, T)
    v = torch.zeros(n, T)
    for k, (i, rw, vl) in enumerate(zip(idx, token_rewards, values)):
        r[k, : len(i)] = rw.float()[i]
        v[k, : len(i)] = vl.float()[i]
    adv = torch.zeros(n, T)
    next_v = torch.zeros(n)  # V of the next step's state
    last = torch.zeros(n)  # A of the next step
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = delta + gamma * lam * last
        next_v = v[:, t]
        adv[:, t] = last
    advantages, returns = [], []
    for k, (i, m) in enumerate(zip(idx, loss_mask)):
        a = torch.zeros(m.shape, dtype=torch.float32)
        ret = torch.zeros(m.shape, dtype=torch.float32)
        a[i] = adv[k, : len(i)]
        ret[i] = adv[k, : len(i)] + v[k, : len(i)]
        advantages.append(a)
        returns.append(ret)
    return advantages, returns


def whiten(advantages: list[Tensor], loss_mask: list[Tensor], eps: float = 1e-8) -> list[Tensor]:
    """(A - mean) / (std + eps) over every response token of the batch (population std), 0 off the mask."""
    import torch  # why: see TYPE_CHECKING above

    on = torch.cat([m.reshape(-1) for m in loss_mask]) != 0 if loss_mask else torch.zeros(0, dtype=torch.bool)
    flat = torch.cat([a.reshape(-1) for a in advantages])[on] if advantages else torch.zeros(0)
    if flat.numel() == 0:
        return [a.clone() for a in advantages]
    mean, std = flat.mean(), flat.std(unbiased=False)
    return [torch.where(m != 0, (a - mean) / (std + eps), torch.zeros_like(a)) for a, m in zip(advantages, loss_mask)]


def _arg(args: Any, name: str) -> Any:
    if not hasattr(args, name):
        raise ValueError(f"advantage gae reads args.{name}, which the update's args do not have")
    return getattr(args, name)


@register_advantage("gae")
def gae_advantage(inputs: AdvantageInputs) -> AdvantageOutputs:
    """`gae` from the update's args `gamma`, `lam` and `gae_whiten` (default true: whiten the
    advantages over the batch's response tokens, as verl and realhf do; the returns stay unwhitened).
    The token rewards are `inputs.token_rewards` (e.g. the KL penalty of `kl_in_reward`, or none) plus
    the outcome reward on each sequence's last response token."""
    if inputs.values is None:
        raise ValueError("advantage gae needs the critic's values: add `values` (critic_inf's output) to the "
                         "update's inputs")
    rewards = outcome_token_rewards(inputs.rewards, inputs.loss_mask)
    if inputs.token_rewards is not None:
        _check("token_rewards", inputs.token_rewards, inputs.loss_mask)
        rewards = [o + t.float() for o, t in zip(rewards, inputs.token_rewards)]
    adv, ret = gae(rewards, inputs.values, inputs.loss_mask, float(_arg(inputs.args, "gamma")),
                   float(_arg(inputs.args, "lam")))
    if getattr(inputs.args, "gae_whiten", True):
        adv = whiten(adv, inputs.loss_mask)
    return AdvantageOutputs(adv, ret)
