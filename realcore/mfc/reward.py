"""`reward`: score each response with a registered reward function (math verifier by default).

The reward runs in child processes (reward_runner.py): one that raises or returns a non-number
gives 0 and is counted in `reward/errors`; one that runs past `reward.timeout_s` gives 0, is
counted in `reward/timeouts`, and is killed.
"""

from __future__ import annotations

import torch

from realcore.api.data import SequenceSample, tensor_to_text
from realcore.api.registry import register_mfc
from realcore.mfc.reward_runner import RewardRunner


def reward_modules(cfg) -> list[str]:
    """What a reward process imports to find registered rewards: ours and the user's."""
    return ["realcore.data", "realcore.mfc", "realcore.workflows", *cfg.imports]


@register_mfc("reward")
class Reward:
    """input_ids, loss_mask, answer -> rewards (one float per sequence)."""

    needs_model = False
    trains = False

    def __init__(self, cfg, mfc):
        self.cfg = cfg
        self.runner: RewardRunner | None = None  # started on first use: only replica heads score

    def run(self, model, batch: SequenceSample):
        if self.runner is None:
            r = self.cfg.reward
            self.runner = RewardRunner(r.type, reward_modules(self.cfg), timeout_s=r.timeout_s, n_procs=r.n_procs)
        tok = model.tokenizer
        items = []
        for sample in batch.samples:
            answer = tensor_to_text(sample["answer"][0])
            for ids, mask in zip(sample["input_ids"], sample["loss_mask"]):
                items.append((tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=True), answer))
        outcomes = self.runner.score(items)
        rewards = [torch.tensor([o.reward]) for o in outcomes]
        out = SequenceSample.from_flat(batch.ids, batch.group_sizes("input_ids"), {"rewards": rewards})
        mean = torch.cat(rewards).mean().item() if rewards else 0.0
        return out, {"reward/mean": mean, "reward/errors": sum(o.error == "error" for o in outcomes),
                     "reward/timeouts": sum(o.error == "timeout" for o in outcomes)}
