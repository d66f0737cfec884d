"""`ppo_update` (clipped PPO with GRPO group advantages, optional KL) and `sft_update`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from realcore.api.data import SequenceSample
from realcore.api.registry import MFCSpec, register_mfc

if TYPE_CHECKING:  # torch and the losses are imported on first use (see realcore.api.data)
    import torch


def _n_tokens(data: dict[str, torch.Tensor]) -> float:
    return float(data["loss_mask"].sum())


@register_mfc("ppo_update")
class PPOUpdate:
    """input_ids, loss_mask, behav_logprobs, rewards [, ref_logprobs] -> stats. One call = one step."""

    # passes mfc.max_tokens_per_mb to the engine; a call makes ppo_n_minibatches x ppo_epochs optimizer steps
    spec = MFCSpec(trains=True, micro_batches=True, head="policy",
                   optimizer_steps=lambda cfg, mfc: cfg.ppo.ppo_n_minibatches * cfg.ppo.ppo_epochs)

    @classmethod
    def check_config(cls, cfg, mfc) -> None:
        reads = {mfc.input_remap.get(k, k) for k in mfc.inputs}
        need = {"input_ids", "loss_mask", "behav_logprobs", "rewards"}
        why = {}
        if cfg.ppo.kl_coef > 0:
            why["ref_logprobs"] = " (ppo.kl_coef > 0)"
        if cfg.ppo.use_decoupled_loss:
            why["prox_logprobs"] = " (ppo.use_decoupled_loss)"
        missing = sorted(need - reads) or sorted(set(why) - reads)
        if missing:
            raise ValueError(f"inputs: ppo_update reads {missing}{why.get(missing[0], '') if len(missing) == 1 else ''}")

    def __init__(self, cfg, mfc):
        self.ppo = cfg.ppo
        self.temperature = cfg.generation.temperature
        self.max_tokens_per_mb = mfc.max_tokens_per_mb  # None: the role's budget

    def loss_fn(self, out, data):
        from realcore.mfc.ppo_functional import kl_loss, ppo_actor_loss  # torch: MFCs register in the master too

        logprobs, entropy = out.logprobs, out.entropy

        mask = data["loss_mask"].float()
        decoupled = self.ppo.use_decoupled_loss
        loss, stats = ppo_actor_loss(
            logprobs, data["behav_logprobs"], data["advantages"], mask,
            eps_clip=self.ppo.eps_clip, c_clip=self.ppo.c_clip,
            prox_logprobs=data["prox_logprobs"] if decoupled else None,
            behav_imp_weight_cap=self.ppo.behav_imp_weight_cap if decoupled else None,
        )
        stats = {f"ppo/{k}": v for k, v in stats.items()}
        mean_entropy = (entropy * mask).sum() / mask.sum().clamp(min=1)
        stats["ppo/entropy"] = mean_entropy.detach()
        if self.ppo.entropy_coef > 0:
            loss = loss - self.ppo.entropy_coef * mean_entropy
        if self.ppo.kl_coef > 0:
            kl = kl_loss(logprobs, data["ref_logprobs"], mask, self.ppo.kl_estimator)
            loss = loss + self.ppo.kl_coef * kl
            stats["ppo/kl"] = kl.detach()
        stats["loss"] = loss.detach()
        return loss, stats

    def run(self, model, batch: SequenceSample):
        import torch  # as in loss_fn: the master registers this MFC without torch

        from realcore.mfc.ppo_functional import group_advantages

        group_sizes = batch.group_sizes("input_ids")
        rewards = torch.cat(batch.flat("rewards")).float() if len(batch) else torch.zeros(0)
        adv = group_advantages(rewards, group_sizes, norm=self.ppo.adv_norm, eps=self.ppo.adv_eps)
        data = {k: batch.flat(k) for k in ("input_ids", "loss_mask", "behav_logprobs")}
        # The sequence's advantage on every token; loss_mask keeps only the response.
        data["advantages"] = [torch.full((len(x),), float(a)) for x, a in zip(data["input_ids"], adv)]
        if self.ppo.kl_coef > 0:
            data["ref_logprobs"] = batch.flat("ref_logprobs")
        if self.ppo.use_decoupled_loss:
            data["prox_logprobs"] = batch.flat("prox_logprobs")
        stats = {}
        for _ in range(self.ppo.ppo_epochs):
            stats = model.train_batch(
                data, self.loss_fn, _n_tokens, n_minibatches=self.ppo.ppo_n_minibatches, temperature=self.temperature,
                max_tokens_per_mb=self.max_tokens_per_mb,
            )
        stats["ppo/adv_abs_mean"] = float(adv.abs().mean()) if len(adv) else 0.0
        return stats


@register_mfc("sft_update")
class SFTUpdate:
    """input_ids, loss_mask -> stats: token-level negative log-likelihood on loss_mask tokens."""

    spec = MFCSpec(trains=True, micro_batches=True, head="policy")  # passes mfc.max_tokens_per_mb to the engine

    def __init__(self, cfg, mfc):
        self.max_tokens_per_mb = mfc.max_tokens_per_mb  # None: the role's budget

    @staticmethod
    def loss_fn(out, data):
        from realcore.mfc.ppo_functional import sft_loss  # torch, as above

        loss, stats = sft_loss(out.logprobs, data["loss_mask"].float())
        stats = {f"sft/{k}": v for k, v in stats.items()}
        stats["loss"] = loss.detach()
        return loss, stats

    def run(self, model, batch: SequenceSample):
        data = {k: batch.flat(k) for k in ("input_ids", "loss_mask")}
        return model.train_batch(data, self.loss_fn, _n_tokens, max_tokens_per_mb=self.max_tokens_per_mb)
