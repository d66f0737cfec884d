"""Attention over packed sequences from their boundaries (`cu_seqlens`), never a dense (T x T) mask.

A packed micro-batch is one row of several sequences. Transformers' sdpa path needs an explicit
block-diagonal mask for that, whose memory grows with T^2 and which rules out flash kernels. This
attention function, registered with transformers' AttentionInterface, takes the boundaries instead
(transformers passes the model call's `cu_seq_lens_q`/`cu_seq_lens_k` keyword arguments down to
every attention layer):
- on CUDA with flash-attn installed: `flash_attn_varlen_func` (the kernel packed training is for);
- otherwise: causal SDPA on each sequence's slice, memory linear in packed tokens for bounded
  sequence lengths, the same numbers as the masked row up to float summation order.

A training engine switches its model to it once (`use_packed_attention`), so that a layer that
gradient checkpointing recomputes in backward attends the same way; generation, with its KV cache
and padding masks, runs inside `standard_attention(model)` (transformers' sdpa). Called without
boundaries (one unpadded sequence per row) it is plain causal attention.
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


def packed_causal_attention(query, key, value, cu: torch.Tensor, *, scale: float | None, dropout: float = 0.0):
    """query (T, H, D), key/value (T, Hkv, D) of one packed row, boundaries `cu` -> (T, H, D).
    Causal within each sequence, nothing across; flash-attn varlen on CUDA when installed, else
    SDPA per sequence. Shared by the HF models (below) and Megatron's core attention."""
    flash = _flash_varlen() if query.is_cuda else None
    if flash is not None:
        longest = int((cu[1:] - cu[:-1]).max())
        return flash(query, key, value, cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scale,
                     causal=True)
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
    out = packed_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu,
                                  scale=scaling, dropout=dropout)
    return out[None].contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

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
    """The keyword arguments transformers hands to every attention layer for one packed row."""
    longest = max(lens)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
