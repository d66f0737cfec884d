"""The algorithm seam: advantage estimators and policy losses as registered pure functions.

A user's estimator or loss is one decorated function in a module listed in `imports:`; the update
MFC's `args:` names it (`advantage: rloo`, `policy_loss: gspo`). Both work on one batch held by one
data-parallel rank: sequences are lists of 1-D tensors aligned as in realcore.api.data
(position t describes x[t] given x[:t]; `loss_mask` is 1 on the trained response tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # torch is imported by the functions, not here: the master registers without it
    from torch import Tensor

_ADVANTAGES: dict[str, Callable] = {}
_POLICY_LOSSES: dict[str, Callable] = {}


@dataclass
class AdvantageInputs:
    """What an advantage estimator may read; absent keys are None.

    rewards        (n_seqs,) float: each sequence's outcome reward (after any shaping)
    group_sizes    sizes of the consecutive groups of sequences sampled from one prompt (sum n_seqs)
    loss_mask      per sequence (len_i,): 1 on the response tokens
    token_rewards  per sequence (len_i,): a reward on each token (e.g. -kl_coef x KL to the reference);
                   the outcome reward is added on the last response token by the estimator that wants it
    values         per sequence (len_i,): the critic's V(x[:t]) (value head alignment, realcore.api.engine)
    args           the update MFC's validated `args:` (gamma, lam, eps, ... whatever the estimator reads)
    """

    rewards: Tensor
    group_sizes: list[int]
    loss_mask: list[Tensor]
    token_rewards: list[Tensor] | None = None
    values: list[Tensor] | None = None
    args: Any = None


@dataclass
class AdvantageOutputs:
    """advantages per sequence (len_i,) (0 off the mask); returns per sequence (len_i,) for a critic's
    target where the estimator defines them (GAE: advantages + values), else None."""

    advantages: list[Tensor]
    returns: list[Tensor] | None = None
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class PolicyLossInputs:
    """One packed micro-batch, every per-token tensor (n_tokens,).

    logprobs       the policy's log-probs now (with grad)
    old_logprobs   the log-probs the ratio is taken against (the behaviour policy's, or the proximal
                   policy's in decoupled PPO), detached
    advantages     per token, detached
    loss_mask      float, 1 on trained tokens (a correction may have zeroed some)
    cu_seqlens     (n_seqs + 1,) sequence boundaries (sequence-level ratios: GSPO)
    args           the update MFC's validated `args:` (eps_clip, eps_clip_high, c_clip, ...)
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    cu_seqlens: Tensor
    args: Any = None


# advantage_fn(inputs: AdvantageInputs) -> AdvantageOutputs
AdvantageFn = Callable[[AdvantageInputs], AdvantageOutputs]
# policy_loss_fn(inputs: PolicyLossInputs) -> (per-token loss (n_tokens,), stats: name -> detached scalar);
# the update aggregates the per-token loss over the mask (token-mean, seq-mean-token-sum, ...)
PolicyLossFn = Callable[[PolicyLossInputs], tuple["Tensor", dict[str, "Tensor"]]]


def _register(reg: dict, kind: str, name: str, fn: Callable) -> Callable:
    if name in reg and reg[name] is not fn:
        raise ValueError(f"{kind} {name!r} is registered twice ({reg[name]!r} and {fn!r})")
    reg[name] = fn
    return fn


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Function decorator: `fn(inputs: AdvantageInputs) -> AdvantageOutputs`, named in `args.advantage`."""
    return lambda fn: _register(_ADVANTAGES, "advantage", name, fn)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Function decorator: `fn(inputs: PolicyLossInputs) -> (per_token_loss, stats)`, named in `args.policy_loss`."""
    return lambda fn: _register(_POLICY_LOSSES, "policy loss", name, fn)


def advantage(name: str) -> AdvantageFn:
    if name not in _ADVANTAGES:
        raise KeyError(f"unknown advantage {name!r}; registered: {sorted(_ADVANTAGES)}")
    return _ADVANTAGES[name]


def policy_loss(name: str) -> PolicyLossFn:
    if name not in _POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; registered: {sorted(_POLICY_LOSSES)}")
    return _POLICY_LOSSES[name]


def advantages_registered() -> list[str]:
    return sorted(_ADVANTAGES)


def policy_losses_registered() -> list[str]:
    return sorted(_POLICY_LOSSES)
