"""Attention over packed sequences from their boundaries (`cu_seqlens`), never a dense (T x T) mask.

A packed micro-batch is one row of several sequences. Transformers' sdpa path needs an explicit
block-diagonal mask for that, whose memory grows with T^2 and which rules out flash kernels. This
attention function, registered with transformers' AttentionInterface, takes the boundaries instead
(transformers passes the model call's `cu_seq_lens_q`/`cu_seq_lens_k` keyword arguments down to
every attention layer):
- on CUDA with flash-attn installed: `flash_attn_varlen_func` (the kernel packed training is for);
- otherwise: causal SDPA on each sequence's slice, memory linear in packed tokens for bounded
  sequence lengths, the same numbers as the masked row up to float summation order.

It is switched on only around a packed forward (`packed_attention(model)`): generation, with its
KV cache and padding masks, keeps the model's own implementation.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.nn.functional as F

NAME = "realcore_varlen"


def _flash_varlen():
    if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> (1, T, H, D), None. Causal within each sequence."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError(f"{NAME} attention needs cu_seq_lens_q (use it through packed_attention)")
    if query.shape[0] != 1:
        raise ValueError(f"{NAME} attention takes one packed row, got a batch of {query.shape[0]}")
    dropout = dropout if module.training else 0.0
    flash = _flash_varlen() if query.is_cuda else None
    if flash is not None:
        max_len = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
        out = flash(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, cu, max_len,
                    max_len, dropout_p=dropout, softmax_scale=scaling, causal=True)  # (T, H, D)
        return out[None], None
    gqa = query.shape[1] != key.shape[1]
    bounds = cu.tolist()
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        parts.append(F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout, scale=scaling, is_causal=True,
            enable_gqa=gqa))
    out = torch.cat(parts, dim=2)  # (1, H, T, D)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)


@contextlib.contextmanager
def packed_attention(model):
    """Within the block, `model` attends by sequence boundaries (pass `**packed_kwargs(lens)` to its call)."""
    _register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


def packed_kwargs(cu: torch.Tensor, lens: list[int]) -> dict:
    """The keyword arguments transformers hands to every attention layer for one packed row."""
    longest = max(lens)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
