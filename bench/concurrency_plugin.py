"""Imported by every process of a bench/concurrency.py run (`imports: [bench.concurrency_plugin]`):
the cheap producer MFC that turns each prompt into one sequence of a fixed length, so that the
three inference MFCs after it cost the same and only their placement differs."""

from __future__ import annotations

import pydantic
import torch

from realcore.api.data import SequenceSample
from realcore.api.registry import MFCSpec, register_mfc


@register_mfc("fixed_length_sequences")
class FixedLengthSequences:
    """prompt_ids -> input_ids: the prompt's tokens repeated to `length` tokens (model-free)."""

    needs_model = False  # the graph read this before MFCSpec; kept for either
    spec = MFCSpec(needs_model=False)

    class Args(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        length: int = pydantic.Field(64, gt=0, description="tokens per sequence")

    def __init__(self, cfg, mfc):
        self.args = self.Args(**mfc.args)

    def run(self, model, batch: SequenceSample):
        out = [p.repeat(self.args.length // max(1, p.numel()) + 1)[: self.args.length].to(torch.long)
               for p in batch.flat("prompt_ids")]
        return SequenceSample.from_flat(batch.ids, batch.group_sizes("prompt_ids"), {"input_ids": out})
