"""Value and score heads on a Megatron GPTModel: the last stage's vocab-parallel output layer
replaced by one linear layer to a single output (a critic's value per token, a reward model's
score per sequence), and the HF layout such a model is saved in.

The head is replicated over the TP ranks (a vocab-parallel layer cannot split one column): each
rank applies it to the full hidden states, so every TP rank computes the same loss, as it does
from the gathered logits of the policy head. With sequence parallel the hidden states arrive split
over TP along the sequence: they are all-gathered, and backward keeps this rank's slice (every
rank holds the full, identical gradient; a reduce-scatter would count it TP times).

HF layout (transformers' GenericFor*Classification, num_labels=1): the decoder under `model.`,
the head as `score.weight` (1, hidden), plus `score.bias` for a value head (token
classification's default `token_classification_bias`); a score head has no bias.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

HEAD_CLASS = {"value": "ForTokenClassification", "score": "ForSequenceClassification"}
_FAMILY = {"llama": "Llama", "qwen2": "Qwen2", "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral"}


def has_bias(head: str, hf_config) -> bool:
    return head == "value" and bool(getattr(hf_config, "token_classification_bias", True))


class ScalarHead(torch.nn.Module):
    """Linear(hidden, 1) with ColumnParallelLinear's call signature (GPTModel calls its output
    layer as `output_layer(hidden, weight=..., runtime_gather_output=...)` -> (out, bias))."""

    def __init__(self, hidden: int, *, bias: bool, sequence_parallel: bool, seed: int, std: float):
        super().__init__()
        # Fresh and the same on every rank (TP replicas and DP replicas alike): from the seed alone.
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(1, hidden, generator=gen) * std)
        self.bias = torch.nn.Parameter(torch.zeros(1)) if bias else None
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def install_head(model, head: str, hf_config, *, sequence_parallel: bool, seed: int) -> None:
    """Replace the last stage's output layer of `model` (a GPTModel built without shared embeddings)."""
    model.output_layer = ScalarHead(hf_config.hidden_size, bias=has_bias(head, hf_config),
                                    sequence_parallel=sequence_parallel, seed=seed,
                                    std=float(getattr(hf_config, "initializer_range", 0.02)))


def head_meta(meta: dict[str, torch.Tensor], head: str, hf_config) -> dict[str, torch.Tensor]:
    """The HF tensor layout (meta tensors) of a head model built from the checkpoint `meta`."""
    out = {k: v for k, v in meta.items() if k != "lm_head.weight" and not k.startswith("score.")}
    out["score.weight"] = torch.empty(1, hf_config.hidden_size, device="meta")
    if has_bias(head, hf_config):
        out["score.bias"] = torch.empty(1, device="meta")
    return out


def head_hf_config(hf_config, head: str, pad_token_id: int | None):
    """The config a head model is saved with: its *For{Token,Sequence}Classification class, one
    label, and a pad token (sequence classification finds each row's last token by it)."""
    family = _FAMILY.get(hf_config.model_type)
    if family is None:
        raise ValueError(f"head={head}: no HF classification class for model_type {hf_config.model_type!r}")
    cfg = copy.deepcopy(hf_config)
    cfg.architectures = [family + HEAD_CLASS[head]]
    cfg.num_labels = 1
    cfg.tie_word_embeddings = False  # the head has no LM head to tie
    if getattr(cfg, "pad_token_id", None) is None:
        eos = getattr(cfg, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        cfg.pad_token_id = pad_token_id if pad_token_id is not None else (eos if eos is not None else 0)
    return cfg


def token_values(per_row: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """values[t] = V(x[:t]): the head's output at row t - 1 (the state after x[:t]); 0 where
    `starts` marks a sequence's first token (aligned like log-probs, realcore.api.data)."""
    return torch.where(starts, 0.0, torch.cat([per_row.new_zeros(1), per_row[:-1]]))
