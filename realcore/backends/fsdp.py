"""Parallelisms of a HF causal LM as plain functions (torchtitan's `parallelize_llama` style):
`apply_ac` (activation checkpointing per transformer block) and `apply_fsdp` (FSDP2 sharding).

Order matters: AC first, then FSDP, so that each FSDP unit wraps a checkpointed block and the
recompute in backward runs inside the unit's own parameter gather (torchtitan: TP, AC, compile, FSDP).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer blocks: the ModuleList whose items are of a class that HF
    names in `_no_split_modules` (e.g. Qwen2DecoderLayer, LlamaDecoderLayer), checkpointed or not."""
    names = set(getattr(model, "_no_split_modules", None) or ())

    def name(m: nn.Module) -> str:
        return type(getattr(m, "_checkpoint_wrapped_module", m)).__name__

    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and all(name(b) in names for b in m):
            return m
    raise ValueError(f"{type(model).__name__}: no list of transformer blocks of the classes in its "
                     f"_no_split_modules ({sorted(names)})")


def apply_ac(model: nn.Module) -> nn.Module:
    """Recompute each transformer block in backward, keeping only its input (non-reentrant
    checkpointing: works with keyword arguments and with FSDP's hooks). In place."""
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard parameters, gradients and optimizer state over the 1-D `mesh` (FSDP2 `fully_shard`):
    one unit per transformer block, then the root (embeddings, final norm, lm_head). In place.

    A unit's parameters are all-gathered before its forward and backward, its gradients
    reduce-scattered after backward, so a rank holds 1/N of them between uses.
    `reshard_after_forward=False` keeps them gathered from forward to backward (ZeRO-2: less
    communication, more memory). `mp_policy` casts the gathered parameters (e.g. to bf16) while
    the sharded fp32 ones stay the optimizer's master copy."""
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        # The last block is the first one backward needs: resharding it would gather it again at once (torchtitan).
        fully_shard(block, **kwargs, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    # The root's parameters (embeddings, lm_head) are kept gathered after forward by FSDP itself.
    fully_shard(model, **kwargs, reshard_after_forward=reshard_after_forward)
    return model
