"""`reward`: score each response with a registered reward function (math verifier by default)."""

from __future__ import annotations

import torch

from realcore.api.data import SequenceSample, tensor_to_text
from realcore.api.registry import lookup, register_mfc


@register_mfc("reward")
class Reward:
    """input_ids, loss_mask, answer -> rewards (one float per sequence)."""

    needs_model = False
    trains = False

    def __init__(self, cfg, mfc):
        self.fn = lookup("reward", cfg.reward.type)

    def run(self, model, batch: SequenceSample):
        tok = model.tokenizer
        rewards = []
        for sample in batch.samples:
            answer = tensor_to_text(sample["answer"][0])
            for ids, mask in zip(sample["input_ids"], sample["loss_mask"]):
                text = tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                rewards.append(torch.tensor([float(self.fn(text, answer))]))
        out = SequenceSample.from_flat(batch.ids, batch.group_sizes("input_ids"), {"rewards": rewards})
        mean = torch.cat(rewards).mean().item() if rewards else 0.0
        return out, {"reward/mean": mean}
