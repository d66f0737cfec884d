"""`inference`: per-token log-probs of `input_ids` under the role's model (e.g. the reference)."""

from __future__ import annotations

from realcore.api.data import SequenceSample
from realcore.api.registry import MFCSpec, register_mfc


@register_mfc("inference")
class Inference:
    """input_ids -> logprobs (temperature-scaled like generation, so ratios compare like with like)."""

    spec = MFCSpec(micro_batches=True, head="policy")  # passes mfc.max_tokens_per_mb to the engine

    def __init__(self, cfg, mfc):
        self.temperature = cfg.generation.temperature
        self.max_tokens_per_mb = mfc.max_tokens_per_mb  # None: the role's budget

    def run(self, model, batch: SequenceSample):
        lps = model.logprobs(batch.flat("input_ids"), temperature=self.temperature,
                             max_tokens_per_mb=self.max_tokens_per_mb)
        return SequenceSample.from_flat(batch.ids, batch.group_sizes("input_ids"), {"logprobs": lps})
