"""`reward`: score each response with a registered reward function (math verifier by default).

The reward runs in child processes (reward_runner.py): one that raises or returns a non-number
gives 0 and is counted in `reward/errors`; one that runs past `reward.timeout_s` gives 0, is
counted in `reward/timeouts`, and is killed.
"""

from __future__ import annotations

from realcore.api.data import SequenceSample, merge_row_fields, tensor_to_text
from realcore.api.registry import MFCSpec, register_mfc
from realcore.workflows.reward_runner import RewardCall, RewardRunner, reward_runner_for


@register_mfc("reward")
class Reward:
    """input_ids, loss_mask and the row's fields it is given (answer, question, and the row's others
    when it reads `fields`) -> rewards (one float per sequence): `fn(prompt, completion, prompt_ids, completion_ids, **row)`; the prompt is what
    precedes the first trained token, the completion the trained tokens."""

    spec = MFCSpec(needs_model=False)

    def __init__(self, cfg, mfc):
        self.cfg = cfg
        self.runner: RewardRunner | None = None  # started on first use: only replica heads score

    def run(self, model, batch: SequenceSample):
        import torch  # MFCs register in the master too, which starts without torch

        if self.runner is None:
            self.runner = reward_runner_for(self.cfg)
        tok = model.tokenizer
        items = []
        for sample in batch.samples:
            row = merge_row_fields({k: tensor_to_text(v[0]) for k, v in sample.items()
                                    if k not in ("input_ids", "loss_mask")})
            for ids, mask in zip(sample["input_ids"], sample["loss_mask"]):
                first = int(mask.nonzero()[0]) if mask.any() else len(ids)
                prompt_ids, completion_ids = ids[:first].tolist(), ids[mask.bool()].tolist()
                items.append(RewardCall(tok.decode(prompt_ids, skip_special_tokens=True),
                                        tok.decode(completion_ids, skip_special_tokens=True), prompt_ids, completion_ids, row))
        outcomes = self.runner.score(items)
        rewards = [torch.tensor([o.reward]) for o in outcomes]
        out = SequenceSample.from_flat(batch.ids, batch.group_sizes("input_ids"), {"rewards": rewards})
        mean = torch.cat(rewards).mean().item() if rewards else 0.0
        return out, {"reward/mean": mean, "reward/errors": sum(o.error == "error" for o in outcomes),
                     "reward/timeouts": sum(o.error == "timeout" for o in outcomes)}
