"""The contract between MFCs and model backends (torch now, Megatron-core later).

The engine knows nothing of PPO: losses are passed in (AReaL-lite's `train_batch`).
Sequences are lists of 1-D tensors; per-token keys follow the alignment in `realcore.api.data`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

Head = Literal["policy", "value", "score"]


@dataclass
class HeadOutput:
    """What a role's head computed on one packed micro-batch: the tensors a loss reads.

    Aligned like every per-token key (realcore.api.data): position t describes x[t] given x[:t],
    and each sequence's position 0 holds 0.
      policy head: logprobs[t] = log p(x[t] | x[:t]) (temperature-scaled), entropy[t] of that distribution
      value head:  values[t] = V(x[:t]), the critic's value of the state before token t
      score head:  scores[i], one scalar per sequence: the head at the sequence's last token
    """

    cu_seqlens: torch.Tensor  # (n_seqs + 1,) int: sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    logprobs: torch.Tensor | None = None  # (n_tokens,)
    entropy: torch.Tensor | None = None  # (n_tokens,)
    values: torch.Tensor | None = None  # (n_tokens,)
    scores: torch.Tensor | None = None  # (n_seqs,)


# loss_fn(out, data) -> (loss, stats)
#   out: the role's HeadOutput for the packed micro-batch, aligned with data["input_ids"]
#   data: every per-token key of the micro-batch, packed (concatenated) into (n_tokens,) tensors;
#         per-sequence keys (one value per sequence) packed into (n_seqs,): a key is per-sequence when
#         every one of its tensors holds one element while input_ids are longer (e.g. a preference
#         pair's label); plus `cu_seqlens`, the micro-batch's sequence boundaries
#   loss: scalar, the mean over this micro-batch's loss tokens; stats: name -> scalar tensor (means)
LossFn = Callable[[HeadOutput, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
# loss_weight_fn(data) -> number of loss tokens in the micro-batch (the weight of its mean)
LossWeightFn = Callable[[dict[str, torch.Tensor]], float]


@dataclass
class GenerationResult:
    output_ids: list[int]
    output_logprobs: list[float]  # log p of each generated token (temperature-scaled logits)
    finish_reason: str  # "stop" | "length" | "abort"


class Engine(ABC):
    """A model role held by one model worker (one data-parallel rank of its mesh)."""

    tokenizer: Any  # the model's HF tokenizer (None when the model directory has none)
    version: int = 0  # completed optimizer updates

    @abstractmethod
    def logprobs(self, input_ids: list[torch.Tensor], temperature: float = 1.0, *,
                 max_tokens_per_mb: int | None = None) -> list[torch.Tensor]:
        """Per-token log-probs of each sequence (float32, same length; position 0 is 0).
        `max_tokens_per_mb`: token budget of one micro-batch of this call (an MFC's own
        `MFCConfig.max_tokens_per_mb`); None: the role's `RoleConfig.max_tokens_per_mb`."""

    def values(self, input_ids: list[torch.Tensor], *, max_tokens_per_mb: int | None = None) -> list[torch.Tensor]:
        """A value-head role: per-token values of each sequence (float32, same length), aligned like
        HeadOutput.values (values[t] = V(x[:t]); position 0 is 0). `max_tokens_per_mb` as in `logprobs`."""
        raise NotImplementedError(f"{type(self).__name__}.values: needs a role with head: value "
                                  f"(this role's head is {_head_of(self)})")

    def scores(self, input_ids: list[torch.Tensor], *, max_tokens_per_mb: int | None = None) -> list[torch.Tensor]:
        """A score-head role: one 0-d float32 tensor per sequence, the head at its last token.
        `max_tokens_per_mb` as in `logprobs`."""
        raise NotImplementedError(f"{type(self).__name__}.scores: needs a role with head: score "
                                  f"(this role's head is {_head_of(self)})")

    @abstractmethod
    def train_batch(
        self,
        data: dict[str, list[torch.Tensor]],
        loss_fn: LossFn,
        loss_weight_fn: LossWeightFn,
        *,
        n_minibatches: int = 1,
        temperature: float = 1.0,
        max_tokens_per_mb: int | None = None,
        group_sizes: list[int] | None = None,
    ) -> dict[str, float]:
        """One optimizer step per minibatch over `data` (must hold `input_ids`; every key per-token or
        per-sequence, see LossFn); `loss_fn` gets the HeadOutput of the role's head. Losses are token-weighted across micro-batches and data-parallel ranks. Returns averaged
        stats plus `grad_norm` and `lr`. `max_tokens_per_mb` as in `logprobs`. `group_sizes`
        (consecutive sequences summing to all of them): a group stays in one micro-batch, for a
        loss over a whole group (DPO's pairs, GSPO's groups)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], gconfig: Any) -> list[GenerationResult]:
        """Sample one continuation per prompt (the caller repeats prompts for groups)."""

    @abstractmethod
    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full weights under HF names, what generation servers load (with LoRA: base and
        adapter merged). A sharded engine (FSDP, Megatron) gathers them: every rank of the role
        calls it; rank 0 gets the weights, the others None."""

    @abstractmethod
    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """LoRA: the adapter's tensors under PEFT's saved names, what an in-memory weight update
        pushes (sharded engines: collective, on rank 0, None elsewhere). Only called on a role
        with `lora`; an engine without LoRA raises NotImplementedError."""

    @abstractmethod
    def save_hf(self, path: str, *, merged: bool = True) -> None:
        """Save weights and tokenizer in HF format (safetensors), loadable by transformers as is,
        atomically; rank 0 writes (sharded engines: every rank calls it). With LoRA the adapter
        folder, plus `merged/` when `lora.export_merged` and `merged` (False for the folder
        generation servers load: they take the adapter alone)."""

    @abstractmethod
    def save_state(self, path: str) -> None:
        """Everything a trainable role needs to continue exactly (weights, optimizer and schedule,
        step counter, random state), written under the existing, empty folder `path`."""

    @abstractmethod
    def load_state(self, path: str) -> None:
        """Restore what save_state wrote, on an engine freshly built from the same model and mesh."""


def _head_of(engine: Engine) -> str:
    role = getattr(engine, "role", None)
    return getattr(role, "head", "policy")
