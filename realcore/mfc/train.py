"""`ppo_update` (an advantage estimator and a policy loss named in its `args:`, see docs/ppo.md) and
`sft_update`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from realcore.api.algorithms import advantage, policy_loss
from realcore.api.config_base import StrictModel
from realcore.api.data import SequenceSample
from realcore.api.registry import MFCSpec, register_mfc

if TYPE_CHECKING:  # torch and the losses are imported on first use (see realcore.api.data)
    import torch

    from realcore.api.engine import HeadOutput


def trained_tokens(input_ids: list, epochs: int) -> int:
    """Tokens the call ran forward and backward (every position of every sequence, each epoch): an
    int, summed over workers; the master divides it by the MFC's time (perf/train_tokens_per_s)."""
    return epochs * sum(len(x) for x in input_ids)


def _n_tokens(data: dict[str, torch.Tensor]) -> float:
    return float(data["loss_mask"].sum())


class PPOArgs(StrictModel):
    """`args:` of a ppo_update node: the algorithm. A None default takes the `ppo:` section's value, so an
    experiment without args trains as before (GRPO advantages, PPO's clipped loss, token mean)."""

    advantage: str = Field("grpo", description="a registered advantage estimator (realcore.api.algorithms): grpo, "
                           "dr-grpo, rloo, reinforce++, reinforce++-baseline, gae, or a user's")
    policy_loss: str = Field("ppo-clip", description="a registered policy loss: ppo-clip, gspo, cispo, sapo, or a user's")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        "token-mean", description="how the per-token policy loss is reduced: mean over loss tokens; mean over "
        "sequences of their token sum; mean over sequences of their token mean (the entropy and KL terms stay "
        "token means)")
    adv_norm: Literal["group", "batch", "none"] | None = Field(
        None, description="grpo's normalisation (PPOConfig.adv_norm); None: ppo.adv_norm")
    adv_eps: float | None = Field(None, gt=0, description="added to the std advantages divide by; None: ppo.adv_eps")
    eps_clip: float | None = Field(None, gt=0, description="lower clip range 1 - eps_clip of the ratio (ppo-clip, "
                                   "gspo, cispo); None: ppo.eps_clip")
    eps_clip_high: float | None = Field(None, gt=0, description="upper clip range 1 + eps_clip_high (DAPO's "
                                        "clip-higher); None: eps_clip")
    c_clip: float | None = Field(None, gt=1, description="ppo-clip's dual-clip constant; None: ppo.c_clip")
    sapo_tau_pos: float = Field(1.0, gt=0, description="sapo: gate temperature for tokens with a positive advantage")
    sapo_tau_neg: float = Field(1.05, gt=0, description="sapo: gate temperature for tokens with a non-positive advantage")
    overlong_buffer: int = Field(0, ge=0, description="DAPO's overlong shaping: a response longer than "
                                 "max_new_tokens - overlong_buffer tokens loses reward linearly, up to "
                                 "overlong_penalty at max_new_tokens; 0: off")
    overlong_penalty: float = Field(1.0, ge=0, description="reward lost by a response of max_new_tokens tokens (or longer)")
    off_policy: Literal["none", "tis", "mis"] = Field(
        "none", description="correction of the sampler/trainer mismatch: tis: each token's loss times min(w, C); "
        "mis: tokens with w outside [1/C, C] dropped; w = exp(recomputed - behav log-prob), the recomputed being "
        "prox_logprobs (an input) or else computed by this MFC with one extra forward pass; the ratio is taken "
        "against them. Not with ppo.use_decoupled_loss (whose behaviour weight does this)")
    off_policy_threshold: float = Field(2.0, gt=1, description="C of off_policy")
    kl_in_reward: float = Field(0.0, ge=0, description="coefficient of a per-token reward -KL(behav || ref) (k1, on "
                                "the response) given to estimators that take token rewards (reinforce++, gae); "
                                "needs the ref_logprobs input")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of token rewards (reinforce++, gae)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE's lambda")
    gae_whiten: bool = Field(True, description="gae: whiten the advantages over the batch's response tokens")
    params: dict[str, Any] = Field(default_factory=dict, description="free settings read by a user's estimator or loss "
                                   "(args.params[NAME])")


def _ppo_steps(cfg, mfc) -> int:
    return cfg.ppo.ppo_n_minibatches * cfg.ppo.ppo_epochs


@register_mfc("ppo_update")
class PPOUpdate:
    """input_ids, loss_mask, behav_logprobs, rewards [, ref_logprobs, prox_logprobs, values, version_start,
    version_end] -> stats. One call = ppo_epochs x ppo_n_minibatches optimizer steps."""

    spec = MFCSpec(trains=True, micro_batches=True, head="policy", optimizer_steps=_ppo_steps)
    Args = PPOArgs

    @classmethod
    def check_config(cls, cfg, mfc) -> None:
        args = PPOArgs(**mfc.args)
        for kind, name, look in (("advantage", args.advantage, advantage), ("policy_loss", args.policy_loss, policy_loss)):
            try:
                look(name)
            except KeyError as e:
                raise ValueError(f"args.{kind}: {e.args[0]}") from None
        if args.off_policy != "none" and cfg.ppo.use_decoupled_loss:
            raise ValueError("args.off_policy: not with ppo.use_decoupled_loss, whose behaviour weight already "
                             "corrects behav vs prox log-probs (cap it with ppo.behav_imp_weight_cap)")
        if args.overlong_buffer > cfg.generation.max_new_tokens:
            raise ValueError(f"args.overlong_buffer: {args.overlong_buffer} exceeds generation.max_new_tokens "
                             f"({cfg.generation.max_new_tokens})")
        reads = {mfc.input_remap.get(k, k) for k in mfc.inputs}
        need = {"input_ids", "loss_mask", "behav_logprobs", "rewards"}
        why = {}
        if cfg.ppo.kl_coef > 0:
            why["ref_logprobs"] = " (ppo.kl_coef > 0)"
        if args.kl_in_reward > 0:
            why["ref_logprobs"] = " (args.kl_in_reward > 0)"
        if cfg.ppo.use_decoupled_loss:
            why["prox_logprobs"] = " (ppo.use_decoupled_loss)"
        if args.advantage == "gae":
            why["values"] = " (args.advantage: gae, from a critic's critic_inf)"
        missing = sorted(need - reads) or sorted(set(why) - reads)
        if missing:
            raise ValueError(f"inputs: ppo_update reads {missing}{why.get(missing[0], '') if len(missing) == 1 else ''}")

    @classmethod
    def unread_inputs(cls, cfg, mfc) -> set[str]:
        """Inputs this config leaves unread (realcore.dfg.prune drops an MFC that only feeds them)."""
        return set() if cfg.ppo.kl_coef > 0 or PPOArgs(**mfc.args).kl_in_reward > 0 else {"ref_logprobs"}

    def __init__(self, cfg, mfc):
        self.ppo = cfg.ppo
        self.temperature = cfg.generation.temperature
        self.max_new_tokens = cfg.generation.max_new_tokens
        self.max_tokens_per_mb = mfc.max_tokens_per_mb  # None: the role's budget
        self.args = self.resolve(PPOArgs(**mfc.args), cfg.ppo)
        self._gaps: list | None = None  # per-token |behav - recomputed| gathered during a call (consistency)
        self._before_step = lambda: True

    @staticmethod
    def resolve(args: PPOArgs, ppo) -> PPOArgs:
        """The args with every None that means "the ppo: section's value" filled in."""
        fill = {k: getattr(ppo, k) for k in ("adv_norm", "adv_eps", "eps_clip", "c_clip") if getattr(args, k) is None}
        return args.model_copy(update=fill)

    def loss_fn(self, out: HeadOutput, data: dict[str, torch.Tensor]):
        import torch  # the master registers this MFC without torch

        from realcore.api.algorithms import PolicyLossInputs
        from realcore.mfc.policy_losses import aggregate, off_policy_weights
        from realcore.mfc.ppo_functional import kl_loss, masked_mean

        a, ppo = self.args, self.ppo
        mask = data["loss_mask"].float()
        on = mask != 0
        logprobs, behav, prox = out.logprobs, data["behav_logprobs"], data.get("prox_logprobs")
        self._watch(logprobs, behav, prox, on & data["same_weights"].bool() if "same_weights" in data else on)
        corrected = ppo.use_decoupled_loss or a.off_policy != "none"
        old = prox if corrected else behav
        per_tok, pstats = policy_loss(a.policy_loss)(
            PolicyLossInputs(logprobs, old, data["advantages"], mask, out.cu_seqlens, a))
        stats = {f"ppo/{k}": v for k, v in pstats.items()}
        if ppo.use_decoupled_loss:
            # Decoupled PPO (Hilton et al. 2022; AReaL): the behaviour weight exp(prox - behav), and 0 past the cap
            w = torch.where(on, prox - behav, torch.zeros_like(behav)).exp()
            keep = on if ppo.behav_imp_weight_cap is None else on & (w <= ppo.behav_imp_weight_cap)
            weight = torch.where(keep, w, torch.zeros_like(w))
            stats["ppo/behav_imp_weight_mean"] = masked_mean(w, keep.float()).detach()
            stats["ppo/behav_mask_frac"] = masked_mean((~keep).float(), mask).detach()
        else:
            weight, ostats = off_policy_weights(behav, prox if prox is not None else behav, mask, a.off_policy,
                                                a.off_policy_threshold)
            if a.off_policy != "none":
                stats.update({f"ppo/{k}": v for k, v in ostats.items()})
        # where, not a product: a dropped token's loss or weight may be inf, and inf * 0 = nan
        per_tok = torch.where(weight != 0, per_tok * weight, torch.zeros_like(per_tok))
        loss = aggregate(per_tok, mask, out.cu_seqlens, a.loss_agg)
        stats["ppo/pg_loss"] = loss.detach()
        mean_entropy = masked_mean(out.entropy, mask)
        stats["ppo/entropy"] = mean_entropy.detach()
        if ppo.entropy_coef > 0:
            loss = loss - ppo.entropy_coef * mean_entropy
        if ppo.kl_coef > 0:
            kl = kl_loss(logprobs, data["ref_logprobs"], mask, ppo.kl_estimator)
            loss = loss + ppo.kl_coef * kl
            stats["ppo/kl"] = kl.detach()
        stats["loss"] = loss.detach()
        return loss, stats

    def loss_weight(self, data: dict[str, torch.Tensor]) -> float:
        from realcore.mfc.policy_losses import loss_weight  # torch, as in loss_fn

        return loss_weight(data, self.args.loss_agg)

    def _watch(self, logprobs, behav, prox, on) -> None:
        """Gather |behav - recomputed| over the trained tokens: recomputed = prox_logprobs when given, else the
        trainer's own log-probs while no optimizer step has been made in this call (the weights that sampled)."""
        if self._gaps is None:
            return
        recomputed = prox if prox is not None else (logprobs.detach() if self._before_step() else None)
        if recomputed is not None:
            self._gaps.append((recomputed.detach() - behav)[on].abs().float())  # on the device: no sync here

    def advantages(self, batch: SequenceSample) -> tuple[list, dict[str, float]]:
        """The estimator's per-token advantages of the batch (after overlong shaping and KL token rewards)."""
        import torch  # as in loss_fn

        from realcore.api.algorithms import AdvantageInputs
        from realcore.mfc.advantages import overlong_penalty

        a, stats = self.args, {}
        mask = batch.flat("loss_mask")
        rewards = torch.cat(batch.flat("rewards")).float() if len(batch) else torch.zeros(0)
        if a.overlong_buffer > 0:
            pen = overlong_penalty(torch.stack([m.sum() for m in mask]) if mask else torch.zeros(0),
                                   self.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
            rewards = rewards + pen
            stats["ppo/overlong_penalty_mean"] = float(pen.mean()) if pen.numel() else 0.0
        behav = batch.flat("behav_logprobs")
        if a.kl_in_reward > 0:  # InstructGPT / realhf: -beta (log pi_behav - log pi_ref) on every response token
            token_rewards = [torch.where(m.bool(), -a.kl_in_reward * (b - r).float(), torch.zeros(()))
                             for m, b, r in zip(mask, behav, batch.flat("ref_logprobs"))]
        else:
            token_rewards = [torch.zeros(len(m)) for m in mask]
        values = batch.flat("values") if "values" in batch.keys() else None
        out = advantage(a.advantage)(AdvantageInputs(rewards, batch.group_sizes("input_ids"), mask, token_rewards,
                                                     values, a))
        if len(out.advantages) != len(mask) or any(x.shape != m.shape for x, m in zip(out.advantages, mask)):
            raise ValueError(f"advantage {a.advantage!r} must return one (len_i,) tensor per sequence")
        per_seq = [float(x[m.bool()].abs().mean()) if m.any() else 0.0 for x, m in zip(out.advantages, mask)]
        stats["ppo/adv_abs_mean"] = sum(per_seq) / len(per_seq) if per_seq else 0.0
        stats.update({f"ppo/{k}": float(v) for k, v in out.stats.items()})
        return out.advantages, stats

    def run(self, model, batch: SequenceSample):
        import torch  # as in loss_fn

        from realcore.mfc.consistency_stats import consistency_stats

        adv, adv_stats = self.advantages(batch)
        data = {k: batch.flat(k) for k in ("input_ids", "loss_mask", "behav_logprobs")}
        data["advantages"] = adv
        if self.ppo.kl_coef > 0:
            data["ref_logprobs"] = batch.flat("ref_logprobs")
        if "prox_logprobs" in batch.keys():
            data["prox_logprobs"] = batch.flat("prox_logprobs")
        elif self.args.off_policy != "none":  # Yao et al.: the trainer's log-probs of the weights that sampled
            data["prox_logprobs"] = model.logprobs(data["input_ids"], self.temperature,
                                                   max_tokens_per_mb=self.max_tokens_per_mb)
        v0 = model.version
        self._gaps, self._before_step = [], lambda: model.version == v0
        if "version_start" in batch.keys() and "version_end" in batch.keys():
            # The gap is watched on sequences sampled wholly by the weights the trainer holds now: the
            # mismatch between engines, not staleness (consistency/version_span measures that).
            data["same_weights"] = [torch.full((len(x),), bool(int(s) == int(e) == v0)) for x, s, e in
                                    zip(data["input_ids"], batch.flat("version_start"), batch.flat("version_end"))]
        try:
            stats = {}
            for _ in range(self.ppo.ppo_epochs):
                stats = model.train_batch(
                    data, self.loss_fn, self.loss_weight, n_minibatches=self.ppo.ppo_n_minibatches,
                    temperature=self.temperature, max_tokens_per_mb=self.max_tokens_per_mb)
            gaps = self._gaps
        finally:
            self._gaps = None
        versions = {k: batch.flat(k) for k in ("version_start", "version_end") if k in batch.keys()}
        stats.update(adv_stats)
        stats.update(consistency_stats(gaps, versions, model))
        stats["train/tokens"] = trained_tokens(data["input_ids"], self.ppo.ppo_epochs)
        return stats


@register_mfc("sft_update")
class SFTUpdate:
    """input_ids, loss_mask -> stats: token-level negative log-likelihood on loss_mask tokens."""

    spec = MFCSpec(trains=True, micro_batches=True, head="policy", optimizer_steps=1)

    def __init__(self, cfg, mfc):
        self.max_tokens_per_mb = mfc.max_tokens_per_mb  # None: the role's budget

    @staticmethod
    def loss_fn(out: HeadOutput, data):
        from realcore.mfc.ppo_functional import sft_loss  # torch, as above

        loss, stats = sft_loss(out.logprobs, data["loss_mask"].float())
        stats = {f"sft/{k}": v for k, v in stats.items()}
        stats["loss"] = loss.detach()
        return loss, stats

    def run(self, model, batch: SequenceSample):
        data = {k: batch.flat(k) for k in ("input_ids", "loss_mask")}
        stats = model.train_batch(data, self.loss_fn, _n_tokens, max_tokens_per_mb=self.max_tokens_per_mb)
        return {**stats, "train/tokens": trained_tokens(data["input_ids"], 1)}
