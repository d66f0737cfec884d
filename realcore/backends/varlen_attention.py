"""Attention over packed sequences from their boundaries (`cu_seqlens`), never a dense (T x T) mask.

A packed micro-batch is one row of several sequences. Transformers' sdpa path needs an explicit
block-diagonal mask for that, whose memory grows with T^2 and which rules out flash kernels. This
attention function, registered with transformers' AttentionInterface, takes the boundaries instead
(transformers passes the model call's `cu_seq_lens_q`/`cu_seq_lens_k` and `max_length_q` keyword
arguments down to every attention layer). `packed_causal_attention` picks a kernel:
- "flash_attn": flash-attn's `flash_attn_varlen_func`, where flash-attn is installed;
- "torch_varlen": else torch's own fused kernel (`torch.nn.attention.varlen.varlen_attn`: flash
  attention inside torch, CUDA GPUs of compute capability 8.0 or more, no dropout);
- "sdpa": else causal SDPA on each sequence's slice (the CPU, a float32 role on a GPU): memory
  linear in packed tokens for bounded sequence lengths, the same numbers as the masked row up to
  float summation order.
The fused kernels take fp16/bf16 only: they run when the compute dtype (autocast's, else the
value's) is one, with q, k and v cast to it (under autocast HF's rotary embedding leaves q and k in
float32 beside a bf16 v), and return what SDPA would (autocast's dtype, else the query's). They take
the longest sequence as a host integer (transformers' `max_length_q`, Megatron's `max_seqlen_q`):
no host sync per layer. The path taken is logged once per process.

A training engine switches its model to it once (`use_packed_attention`), so that a layer that
gradient checkpointing recomputes in backward attends the same way; generation, with its KV cache
and padding masks, runs inside `standard_attention(model)` (transformers' sdpa). Called without
boundaries (one unpadded sequence per row) it is plain causal attention.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "realcore_varlen"
FUSED_DTYPES = (torch.float16, torch.bfloat16)
log = logging.getLogger("realcore.varlen_attention")
_logged: set[str] = set()


@functools.cache
def _flash_attn():
    """flash-attn's varlen kernel, or None where flash-attn is not installed."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_varlen_func  # optional: not installed on CPU machines

    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    """torch's fused varlen kernel (torch >= 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # only in torch >= 2.10
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _torch_varlen_runs_on(index: int) -> bool:
    """torch's varlen kernel is flash attention: built into this torch, on an Ampere or later GPU."""
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(index)[0] >= 8


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _compute_dtype(query: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """Autocast's dtype where it is on (it would cast SDPA's inputs to it), else the value's."""
    kind = query.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return value.dtype


def _kernel(query: torch.Tensor, dtype: torch.dtype, dropout: float):
    """(name, kernel(q, k, v, cu, longest, scale, dropout)) of the fused path for these inputs, or None."""
    if not _on_gpu(query) or dtype not in FUSED_DTYPES:
        return None
    flash = _flash_attn()
    if flash is not None:
        def run_flash(q, k, v, cu, longest, scale, dropout):
            return flash(q, k, v, cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scale, causal=True)
        return "flash_attn", run_flash
    varlen = _torch_varlen()
    if varlen is not None and dropout == 0.0 and _torch_varlen_runs_on(query.device.index or 0):
        def run_torch(q, k, v, cu, longest, scale, dropout):
            # window (-1, 0) is its causal mask; GQA natively (fewer key/value heads than query heads)
            return varlen(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0),
                          enable_gqa=q.shape[1] != k.shape[1])
        return "torch_varlen", run_torch
    return None


def _log_path(name: str) -> None:
    if name not in _logged:
        _logged.add(name)
        log.info("packed attention: %s", name)


def packed_causal_attention(query, key, value, cu: torch.Tensor, *, scale: float | None, dropout: float = 0.0,
                            max_len: int | None = None):
    """query (T, H, D), key/value (T, Hkv, D) of one packed row, boundaries `cu` ((n + 1,) int32, on
    the row's device) -> (T, H, D). Causal within each sequence, nothing across. `max_len`: the
    longest sequence, a host int (None: read from `cu`, a host sync). Shared by the HF models (below)
    and Megatron's core attention."""
    dtype = _compute_dtype(query, value)
    kernel = _kernel(query, dtype, dropout)
    if kernel is not None:
        name, run = kernel
        _log_path(name)
        longest = int(max_len) if max_len is not None else int((cu[1:] - cu[:-1]).max())
        out = run(query.to(dtype), key.to(dtype), value.to(dtype), cu.to(torch.int32), longest, scale, dropout)
        return out if torch.is_autocast_enabled(query.device.type) else out.to(query.dtype)
    _log_path("sdpa")
    gqa = query.shape[1] != key.shape[1]
    q, k, v = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)  # (H, T, D)
    bounds = cu.tolist()
    parts = [F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], dropout_p=dropout, scale=scale,
                                            is_causal=True, enable_gqa=gqa)
             for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=1).transpose(0, 1)  # (T, H, D)


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> (1, T, H, D), None. Causal within each sequence."""
    cu = kwargs.get("cu_seq_lens_q")
    dropout = dropout if module.training else 0.0
    if cu is None:  # whole rows, each one sequence
        if attention_mask is not None or query.shape[2] != key.shape[2]:
            raise ValueError(f"{NAME} attention: no padding masks or KV cache (generate inside standard_attention)")
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"{NAME} attention takes one packed row, got a batch of {query.shape[0]}")
    longest = kwargs.get("max_length_q")
    out = packed_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu,
                                  scale=scaling, dropout=dropout, max_len=longest if isinstance(longest, int) else None)
    return out[None].contiguous(), None


def _register() -> None:
    AttentionInterface.register(NAME, varlen_attention)


def use_packed_attention(model) -> None:
    """From now on `model` attends by sequence boundaries (pass `**packed_kwargs(...)` to its calls)."""
    _register()
    model.config._attn_implementation = NAME


@contextlib.contextmanager
def standard_attention(model):
    """Within the block, `model` uses transformers' sdpa attention (padding masks, KV cache)."""
    before = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        model.config._attn_implementation = before


def packed_kwargs(cu: torch.Tensor, lens: list[int]) -> dict:
    """The keyword arguments transformers hands to every attention layer for one packed row (the
    longest sequence as a Python int: the fused kernels take it from the host)."""
    longest = max(lens)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
