"""`generate`: sample `n_samples` responses per prompt with the role's built-in engine."""

from __future__ import annotations

import torch

from realcore.api.data import SequenceSample
from realcore.api.registry import register_mfc


@register_mfc("generate")
class Generate:
    """prompt_ids -> input_ids (prompt + response), loss_mask (1 on the response), behav_logprobs."""

    needs_model = True
    trains = False
    generates = True  # samples only: runs on generation servers when the experiment has them

    def __init__(self, cfg, mfc):
        self.gconfig = cfg.generation

    def run(self, model, batch: SequenceSample):
        n = self.gconfig.n_samples
        prompts = [p.tolist() for p in batch.flat("prompt_ids") for _ in range(n)]
        results = model.generate(prompts, self.gconfig)
        input_ids, loss_mask, behav_logprobs = [], [], []
        for prompt, r in zip(prompts, results):
            p, o = len(prompt), len(r.output_ids)
            input_ids.append(torch.tensor(prompt + r.output_ids, dtype=torch.int64))
            loss_mask.append(torch.cat([torch.zeros(p, dtype=torch.int64), torch.ones(o, dtype=torch.int64)]))
            behav_logprobs.append(torch.cat([torch.zeros(p), torch.tensor(r.output_logprobs, dtype=torch.float32)]))
        lens = [len(r.output_ids) for r in results]
        stats = {
            "gen/response_len": sum(lens) / max(len(lens), 1),
            "gen/no_eos_frac": sum(r.finish_reason == "length" for r in results) / max(len(results), 1),
        }
        out = SequenceSample.from_flat(
            batch.ids, [n] * len(batch), {"input_ids": input_ids, "loss_mask": loss_mask, "behav_logprobs": behav_logprobs}
        )
        return out, stats
