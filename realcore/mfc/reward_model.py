"""Reward models: `rm_train` (Bradley-Terry on preference pairs), `rm_inf` (a score per sequence)
and `combine_rewards` (an RL reward from a rule reward and a reward model's score).

A reward model is a role with `head: score`: one scalar per sequence, the value head at its last
token (realcore.api.engine.HeadOutput.scores). Preference pairs come from realcore.data.preferences:
a sample is one pair, chosen first. See docs/reward-models.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from realcore.api.config_base import StrictModel
from realcore.api.data import SequenceSample
from realcore.api.registry import MFCSpec, register_mfc

if TYPE_CHECKING:  # torch is imported on first use: MFCs register in the master too, which starts without it
    import torch


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry pairwise loss (Bradley & Terry 1952; as a reward-model loss: Ouyang et al. 2022,
    InstructGPT eq. 1): P(chosen > rejected) = sigmoid(s_c - s_r), and the loss is its negative log,
    mean over pairs:  loss = -mean_i log sigmoid(s_c,i - s_r,i).
    chosen, rejected: (n_pairs,) scores. Stats: rm/loss, rm/accuracy (fraction of pairs with
    s_c > s_r, ties count as wrong), rm/margin (mean s_c - s_r)."""
    import torch  # as above
    import torch.nn.functional as F

    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"bradley_terry_loss: chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} "
                         "must be two (n_pairs,) tensors")
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()  # logsigmoid: stable for large negative margins
    with torch.no_grad():
        stats = {"rm/loss": loss.detach(), "rm/accuracy": (margin > 0).float().mean(), "rm/margin": margin.mean()}
    return loss, stats


def pair_side_marks(lens: list[int]) -> list[torch.Tensor]:
    """Per-token key `pair_side` of a batch of pairs (chosen, rejected, chosen, ...): +1 on a chosen
    sequence's first token, -1 on a rejected one's, 0 elsewhere. Per token, not per sequence, so every
    engine packs it as it packs input_ids; the loss reads it at the sequence starts (cu_seqlens) to
    check that each micro-batch holds whole pairs in order, and the loss weight counts its +1s."""
    import torch  # as above

    out = []
    for i, n in enumerate(lens):
        t = torch.zeros(n, dtype=torch.float32)
        t[0] = 1.0 if i % 2 == 0 else -1.0
        out.append(t)
    return out


def n_pairs(data: dict[str, torch.Tensor]) -> float:
    """The loss weight of a micro-batch: its number of pairs (the loss is a mean over pairs)."""
    return float((data["pair_side"] > 0).sum())


def pair_loss(out, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss_fn(HeadOutput, packed data) of rm_train: Bradley-Terry over the micro-batch's pairs."""
    if out.scores is None:
        raise ValueError("rm_train: the role's head gave no scores (its role needs head: score)")
    side = data["pair_side"][out.cu_seqlens[:-1].long()]  # (n_seqs,): +1 chosen, -1 rejected
    n = side.numel()
    if n % 2 or not bool((side[0::2] > 0).all()) or not bool((side[1::2] < 0).all()):
        raise AssertionError(f"rm_train: a micro-batch must hold whole pairs, chosen first; got sides {side.tolist()}")
    s = out.scores.float()  # (n_seqs,)
    loss, stats = bradley_terry_loss(s[0::2], s[1::2])
    stats["loss"] = loss.detach()
    return loss, stats


def pairwise_accuracy(scores: list[torch.Tensor]) -> tuple[float, float]:
    """(fraction of pairs with s_chosen > s_rejected, mean margin) of scores laid out chosen, rejected, ..."""
    import torch  # as above

    s = torch.stack([x.reshape(()) for x in scores]).float()
    margin = s[0::2] - s[1::2]
    return float((margin > 0).float().mean()), float(margin.mean())


def _check_pairs(batch: SequenceSample) -> None:
    for sid, g in zip(batch.ids, batch.group_sizes("input_ids")):
        if g != 2:
            raise ValueError(f"rm_train: sample {sid} holds {g} sequences; a preference sample is one pair "
                             "(chosen, rejected): use a preference dataset (arith-preference, preference-jsonl)")


@register_mfc("rm_train")
class RMTrain:
    """input_ids (pairs: chosen, rejected) -> stats. One optimizer step per call, Bradley-Terry loss."""

    spec = MFCSpec(trains=True, micro_batches=True, head="score", optimizer_steps=1)

    class Args(StrictModel):
        eval_freq_steps: int | None = Field(
            None, gt=0, description="score the held-out pairs of the training dataset (dataset.holdout > 0) after "
            "every N optimizer steps and after the run's last, logging rm/eval_accuracy (fraction of pairs with "
            "chosen scored above rejected) and rm/eval_margin; also rm/eval_accuracy_init before the first step. "
            "None: never")
        eval_pairs: int = Field(128, gt=0, description="most held-out pairs scored per evaluation (distinct prompts)")

    @classmethod
    def check_config(cls, cfg, mfc) -> None:
        reads = {mfc.input_remap.get(k, k) for k in mfc.inputs}
        if "input_ids" not in reads:
            raise ValueError("inputs: rm_train reads input_ids (preference pairs, chosen first)")
        args = cls.Args(**mfc.args)
        if args.eval_freq_steps is not None:
            if not cfg.dataset.holdout:
                raise ValueError("args.eval_freq_steps: needs dataset.holdout > 0 (the held-out pairs it scores)")
            if cfg.dataset.type not in ("arith-preference", "preference-jsonl"):
                raise ValueError(f"args.eval_freq_steps: held-out pairs come from arith-preference or "
                                 f"preference-jsonl, not dataset.type={cfg.dataset.type!r}")

    def __init__(self, cfg, mfc):
        self.cfg, self.args = cfg, self.Args(**mfc.args)
        self.max_tokens_per_mb = mfc.max_tokens_per_mb  # None: the role's budget
        self.heldout: list | None = None  # loaded on the first evaluation

    def _evaluate(self, model) -> tuple[float, float]:
        from realcore.data.preferences import load_heldout_pairs  # torch: the master registers this MFC

        if self.heldout is None:
            self.heldout = load_heldout_pairs(self.cfg.dataset, model.tokenizer,
                                              use_chat_template=self.cfg.model.use_chat_template,
                                              n=self.args.eval_pairs)
            if not self.heldout:
                raise ValueError("rm_train: dataset.holdout leaves no held-out pairs to evaluate on")
        seqs = [x for p in self.heldout for x in p["input_ids"]]
        return pairwise_accuracy(model.scores(seqs, max_tokens_per_mb=self.max_tokens_per_mb))

    def run(self, model, batch: SequenceSample):
        _check_pairs(batch)
        stats = {}
        freq = self.args.eval_freq_steps
        if freq is not None and model.version == 0:
            stats["rm/eval_accuracy_init"], _ = self._evaluate(model)
        seqs = batch.flat("input_ids")
        data = {"input_ids": seqs, "pair_side": pair_side_marks([len(x) for x in seqs])}
        stats.update(model.train_batch(data, pair_loss, n_pairs, max_tokens_per_mb=self.max_tokens_per_mb,
                                       group_sizes=[2] * len(batch)))
        if freq is not None and (model.version % freq == 0 or model.version >= self.cfg.trainer.total_steps):
            stats["rm/eval_accuracy"], stats["rm/eval_margin"] = self._evaluate(model)
        return stats


@register_mfc("rm_inf")
class RMInference:
    """input_ids -> rm_scores: the reward model's score of each sequence (one float per sequence)."""

    spec = MFCSpec(micro_batches=True, head="score")

    def __init__(self, cfg, mfc):
        self.max_tokens_per_mb = mfc.max_tokens_per_mb  # None: the role's budget

    def run(self, model, batch: SequenceSample):
        import torch  # as above

        scores = [s.reshape(1).float() for s in model.scores(batch.flat("input_ids"),
                                                              max_tokens_per_mb=self.max_tokens_per_mb)]
        out = SequenceSample.from_flat(batch.ids, batch.group_sizes("input_ids"), {"rm_scores": scores})
        return out, {"rm/score_mean": float(torch.cat(scores).mean()) if scores else 0.0}


@register_mfc("combine_rewards")
class CombineRewards:
    """rule_rewards, rm_scores -> rewards = rule_weight x rule_rewards + rm_weight x rm_scores, per
    sequence. An input whose weight is 0 may be left out (a reward model's score alone: rm_weight 1,
    rule_weight 0, only rm_scores read)."""

    spec = MFCSpec(needs_model=False)

    class Args(StrictModel):
        rule_weight: float = Field(1.0, description="weight of rule_rewards (e.g. the math verifier's) in rewards")
        rm_weight: float = Field(1.0, description="weight of rm_scores (a reward model's, from rm_inf) in rewards")

    @classmethod
    def check_config(cls, cfg, mfc) -> None:
        args = cls.Args(**mfc.args)
        if args.rule_weight == 0 and args.rm_weight == 0:
            raise ValueError("args: rule_weight and rm_weight are both 0: rewards would be 0 for every sequence")
        reads = {mfc.input_remap.get(k, k) for k in mfc.inputs}
        for key, w in (("rule_rewards", args.rule_weight), ("rm_scores", args.rm_weight)):
            if w != 0 and key not in reads:
                raise ValueError(f"inputs: combine_rewards reads {key} ({key.split('_')[0]}_weight is {w})")
        if list(mfc.outputs) != ["rewards"]:
            raise ValueError(f"outputs: combine_rewards writes [rewards], not {list(mfc.outputs)}")

    def __init__(self, cfg, mfc):
        self.args = self.Args(**mfc.args)

    def run(self, model, batch: SequenceSample):
        import torch  # as above

        weights = {"rule_rewards": self.args.rule_weight, "rm_scores": self.args.rm_weight}
        read = [k for k, w in weights.items() if w != 0]  # a weight-0 input need not be there
        sizes = batch.group_sizes(read[0])
        rewards = [torch.zeros(1) for _ in range(sum(sizes))]
        stats = {}
        for k in read:
            vals = [t.float().reshape(1) for t in batch.flat(k)]
            if len(vals) != len(rewards):
                raise ValueError(f"combine_rewards: {len(vals)} {k} for {len(rewards)} sequences")
            rewards = [r + weights[k] * v for r, v in zip(rewards, vals)]
            stats[f"reward/{'rule' if k == 'rule_rewards' else 'rm'}_mean"] = float(torch.cat(vals).mean()) if vals else 0.0
        stats["reward/combined_mean"] = float(torch.cat(rewards).mean()) if rewards else 0.0
        return SequenceSample.from_flat(batch.ids, sizes, {"rewards": rewards}), stats
