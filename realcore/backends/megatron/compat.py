"""Fixes megatron-core 0.16.1 needs on every device, GPUs included, for the local (non-
TransformerEngine) layer spec realcore builds. cpu_compat.py applies these too, plus what only a
CPU needs.

- MoE router without TransformerEngine: `moe_utils` imports `te_general_gemm` only inside its
  `try: import transformer_engine`, then reads the name unguarded (NameError on the first routed
  token). Defined as None (the plain matmul path) where TransformerEngine did not define it.
- Sequence parallel with torch's norm: `WrappedTorchNorm` refuses `config.sequence_parallel`. A norm
  is elementwise over tokens, so it is right on a sequence shard as long as its replicated
  parameters are tagged for the SP gradient all-reduce (`param.sequence_parallel`), which is what
  TransformerEngine's and apex's norms do.
"""

from __future__ import annotations

from megatron.core.transformer import torch_norm
from megatron.core.transformer.moe import moe_utils

_applied = False


def apply_compat() -> None:
    """Patch megatron-core (idempotent); call before building models."""
    global _applied
    if _applied:
        return
    _define_te_general_gemm()
    _allow_sequence_parallel_torch_norm()
    _applied = True


def _define_te_general_gemm() -> None:
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _allow_sequence_parallel_torch_norm() -> None:
    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        norm = original_new(cls, _copy_with(config, sequence_parallel=False), hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


def _copy_with(obj, **changes):
    """Shallow copy of `obj` with some attributes replaced (skips dataclass __post_init__)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new
