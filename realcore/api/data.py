"""SequenceSample: the unit of data that MFCs read and write.

A *sample* is one buffer entry (one prompt). Each key of a sample holds a list of 1-D tensors, one
per sequence (a generated group has `n_samples` sequences; a prompt has one). Per-token keys have
the length of their sequence; per-sequence scalars are 1-element tensors; text is a uint8 tensor of
UTF-8 bytes (see `text_to_tensor`).

Token alignment convention (all per-token keys): for a sequence x of length L,
`logprobs[t] = log p(x[t] | x[:t])` for t >= 1 and `logprobs[0] = 0`; `loss_mask[t] = 1` on the
generated (response) tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor is made: a process that only routes samples starts without it
    import torch

Sample = dict[str, list["torch.Tensor"]]


@dataclass
class SequenceSample:
    ids: list[int]
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self):
        if len(self.ids) != len(self.samples):
            raise ValueError(f"SequenceSample: {len(self.ids)} ids but {len(self.samples)} samples")

    def __len__(self) -> int:
        return len(self.ids)

    def keys(self) -> set[str]:
        return set().union(*(s.keys() for s in self.samples)) if self.samples else set()

    def flat(self, key: str) -> list[torch.Tensor]:
        """All sequences of `key`, sample after sample."""
        return [t for s in self.samples for t in s[key]]

    def group_sizes(self, key: str) -> list[int]:
        return [len(s[key]) for s in self.samples]

    def seqlens(self, key: str) -> list[list[int]]:
        return [[int(t.numel()) for t in s[key]] for s in self.samples]

    @staticmethod
    def from_flat(ids: list[int], group_sizes: list[int], data: dict[str, list[torch.Tensor]]) -> "SequenceSample":
        """Inverse of `flat`: cut flat per-sequence lists back into samples of `group_sizes`."""
        samples: list[Sample] = [{} for _ in ids]
        for key, seqs in data.items():
            if len(seqs) != sum(group_sizes):
                raise ValueError(f"key {key!r}: {len(seqs)} sequences for groups {group_sizes}")
            pos = 0
            for s, g in zip(samples, group_sizes):
                s[key] = list(seqs[pos : pos + g])
                pos += g
        return SequenceSample(list(ids), samples)


# The buffer key of a dataset row's other fields (besides its prompt and answer), as JSON text: they
# reach the reward and the workflow by name (`merge_row_fields`), whatever their types.
ROW_FIELDS = "fields"


def merge_row_fields(data: dict) -> dict:
    """`data` with its ROW_FIELDS text (if any) replaced by the fields it holds; a field never
    replaces a key `data` already has."""
    text = data.pop(ROW_FIELDS, None)
    for k, v in (json.loads(text) if text else {}).items():
        data.setdefault(k, v)
    return data


def text_to_tensor(text: str) -> torch.Tensor:
    import torch  # a process that only routes samples starts without it (see above)

    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)


def tensor_to_text(t: torch.Tensor) -> str:
    import torch  # as above

    return bytes(t.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def chat_template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template with the generation prompt,
    whatever shape transformers returns them in (a list, a BatchEncoding in transformers 5, a
    tensor, a batch of one)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):  # batched form [[...]]
        assert len(out) == 1, f"one conversation in, {len(out)} out"
        out = out[0]
    return [int(t) for t in out]
