"""The critic of PPO (docs/critic.md): `critic_inf` (a value-head role's values) and `critic_train`
(GAE returns, clipped value loss), both on a role with `head: value`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from realcore.api.config_base import StrictModel
from realcore.api.data import SequenceSample
from realcore.api.registry import MFCSpec, register_mfc

if TYPE_CHECKING:  # torch is imported on first use: the master registers these MFCs without it
    import torch

    from realcore.api.engine import HeadOutput


@register_mfc("critic_inf")
class CriticInference:
    """input_ids -> values: V(x[:t]) at every position (0 at each sequence's start), by the role's value head."""

    spec = MFCSpec(micro_batches=True, head="value")

    def __init__(self, cfg, mfc):
        self.max_tokens_per_mb = mfc.max_tokens_per_mb  # None: the role's budget

    def run(self, model, batch: SequenceSample):
        values = model.values(batch.flat("input_ids"), max_tokens_per_mb=self.max_tokens_per_mb)
        return SequenceSample.from_flat(batch.ids, batch.group_sizes("input_ids"), {"values": values})


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor,
               value_eps_clip: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO2's clipped value loss (baselines' ppo2; realhf's critic_loss_fn), token mean over the mask:

        V_clip = clip(V, V_old - eps_v, V_old + eps_v)
        loss   = sum_t mask_t max((V_t - R_t)^2, (V_clip_t - R_t)^2) / 2 / sum_t mask_t

    value_eps_clip None: the plain (V - R)^2 / 2. Stats (detached): value_loss, and clipfrac, the
    fraction of mask tokens whose loss took the clipped term."""
    import torch  # why: see TYPE_CHECKING above

    mask = loss_mask.float()
    on = mask != 0
    denom = mask.sum().clamp(min=1)
    R, V_old = returns.detach().float(), old_values.detach().float()
    loss1 = (values - R) ** 2
    if value_eps_clip is None:
        per_token, clipped = loss1, torch.zeros_like(on)
    else:
        V_clip = V_old + (values - V_old).clamp(-value_eps_clip, value_eps_clip)
        loss2 = (V_clip - R) ** 2
        per_token, clipped = torch.maximum(loss1, loss2), loss2 > loss1
    # where, not only a product: a prompt token's value may be anything, and inf * 0 = nan.
    loss = 0.5 * (torch.where(on, per_token, torch.zeros_like(per_token)) * mask).sum() / denom
    return loss, {"value_loss": loss.detach(), "clipfrac": ((clipped & on).float() * mask).sum() / denom}


def explained_variance(values: list[torch.Tensor], returns: list[torch.Tensor], loss_mask: list[torch.Tensor]) -> float:
    """1 - Var[R - V] / Var[R] over the batch's response tokens (cleanrl's `explained_var`): 1 for a
    perfect critic, 0 for one that predicts the mean, negative for worse; 0 when the returns do not vary."""
    import torch  # why: see TYPE_CHECKING above

    on = torch.cat([m.reshape(-1) for m in loss_mask]) != 0
    V = torch.cat([v.reshape(-1).float() for v in values])[on]
    R = torch.cat([r.reshape(-1).float() for r in returns])[on]
    var_r = R.var(unbiased=False) if R.numel() else torch.tensor(0.0)
    if var_r <= 0:
        return 0.0
    return float(1 - (R - V).var(unbiased=False) / var_r)


def _n_tokens(data: dict[str, torch.Tensor]) -> float:
    return float(data["loss_mask"].sum())


def _steps_per_call(cfg, mfc) -> int:
    args = CriticTrain.Args(**mfc.args)
    return args.n_minibatches * args.epochs


@register_mfc("critic_train")
class CriticTrain:
    """input_ids, loss_mask, rewards, values [, behav_logprobs, ref_logprobs] -> stats (all `critic/...`).

    The returns are GAE's (realcore.mfc.gae) from the token rewards (outcome on the last response
    token, minus kl_in_reward x (behav - ref) on each) and the values critic_inf gave before this
    step; the loss is the clipped value loss against those values. `gamma`, `lam` and `kl_in_reward`
    are ppo_update's keys, so one YAML anchor sets both (the actor's advantages and the critic's
    targets then come from the same rewards)."""

    class Args(StrictModel):
        value_eps_clip: float | None = Field(
            0.2, gt=0, description="the new value is clipped to within value_eps_clip of critic_inf's value "
            "(PPO2's clipped value loss); None: the unclipped (V - R)^2 / 2")
        gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount (as ppo_update's gamma)")
        lam: float = Field(1.0, ge=0, le=1, description="GAE's lambda (as ppo_update's lam)")
        kl_in_reward: float = Field(
            0.0, ge=0, description="each response token's reward gets -kl_in_reward x (behav - ref log-prob) (as "
            "ppo_update's kl_in_reward); > 0 needs the inputs behav_logprobs and ref_logprobs")
        n_minibatches: int = Field(1, gt=0, description="each data-parallel rank splits its batch into this many "
                                   "minibatches, one optimizer step each")
        epochs: int = Field(1, gt=0, description="passes over the batch per call, each n_minibatches optimizer "
                            "steps; the returns stay those computed before the first")

    spec = MFCSpec(trains=True, micro_batches=True, head="value", optimizer_steps=_steps_per_call)

    @classmethod
    def check_config(cls, cfg, mfc) -> None:
        reads = {mfc.input_remap.get(k, k) for k in mfc.inputs}
        need = ["input_ids", "loss_mask", "rewards", "values"]
        if cls.Args(**mfc.args).kl_in_reward > 0:
            need += ["behav_logprobs", "ref_logprobs"]
        missing = [k for k in need if k not in reads]
        if missing:
            raise ValueError(f"inputs: critic_train reads {missing}"
                             f"{' (args.kl_in_reward > 0)' if set(missing) & {'behav_logprobs', 'ref_logprobs'} else ''}")

    @classmethod
    def unread_inputs(cls, cfg, mfc) -> set[str]:
        """Inputs this config leaves unread (realcore.dfg.prune drops an MFC that only feeds them)."""
        return set() if cls.Args(**mfc.args).kl_in_reward > 0 else {"behav_logprobs", "ref_logprobs"}

    def __init__(self, cfg, mfc):
        self.args = self.Args(**mfc.args)
        self.max_tokens_per_mb = mfc.max_tokens_per_mb  # None: the role's budget

    def loss_fn(self, out: HeadOutput, data: dict[str, torch.Tensor]):
        return value_loss(out.values, data["values"], data["returns"], data["loss_mask"], self.args.value_eps_clip)

    def run(self, model, batch: SequenceSample):
        import torch  # why: see TYPE_CHECKING above

        from realcore.mfc.gae import gae, kl_token_rewards

        a = self.args
        mask, values = batch.flat("loss_mask"), batch.flat("values")
        rewards = torch.cat(batch.flat("rewards")).float() if len(batch) else torch.zeros(0)
        kl = a.kl_in_reward > 0
        token_rewards = kl_token_rewards(rewards, batch.flat("behav_logprobs") if kl else None,
                                         batch.flat("ref_logprobs") if kl else None, mask, a.kl_in_reward)
        _, returns = gae(token_rewards, values, mask, a.gamma, a.lam)
        data = {"input_ids": batch.flat("input_ids"), "loss_mask": mask, "values": values, "returns": returns}
        stats = {}
        for _ in range(a.epochs):
            stats = model.train_batch(data, self.loss_fn, _n_tokens, n_minibatches=a.n_minibatches,
                                      max_tokens_per_mb=self.max_tokens_per_mb)
        # Every stat under critic/: the actor's update reports loss, grad_norm and lr too.
        stats = {k if k.startswith("critic/") else f"critic/{k}": v for k, v in stats.items()}
        stats["critic/explained_variance"] = explained_variance(values, returns, mask) if len(batch) else 0.0
        stats["critic/return_mean"] = _masked_mean(returns, mask)
        stats["critic/value_mean"] = _masked_mean(values, mask)
        return stats


def _masked_mean(seqs: list[torch.Tensor], loss_mask: list[torch.Tensor]) -> float:
    n = sum(float(m.sum()) for m in loss_mask)
    return sum(float((s.float() * m.float()).sum()) for s, m in zip(seqs, loss_mask)) / max(n, 1.0)
