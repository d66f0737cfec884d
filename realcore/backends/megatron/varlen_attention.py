"""Megatron's local core attention over packed sequences by their boundaries (THD), no dense mask.

megatron-core's local `DotProductAttention` takes only a (T x T) mask; its packed (THD) format is
TransformerEngine's. This subclass takes `PackedSeqParams(qkv_format="thd")` too: Megatron's
`Attention` then hands it query (T, heads, dim) and key/value (T, groups, dim) with RoPE already
applied per sequence (positions restart at 0 at each boundary), and it attends causally within each
sequence (`packed_causal_attention`: flash-attn's or torch's fused varlen kernel on a GPU in
bf16, SDPA per sequence elsewhere), the longest sequence taken from the params (a host integer: no
host sync per layer). Memory grows with the packed tokens, not their square. Without packed params it is the
parent class, unchanged.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from realcore.backends.device import to_device
from realcore.backends.varlen_attention import packed_causal_attention


class VarlenDotProductAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None or self.softmax_offset is not None:
            raise ValueError("megatron varlen attention: THD packing without attention bias or softmax offset only")
        if self.scale_mask_softmax.window_size is not None:
            raise ValueError("megatron varlen attention: sliding-window layers need a mask (not supported packed)")
        dropout = self.attention_dropout.p if self.training else 0.0
        # The parent divides its scale by the layer number under query-key layer scaling and its
        # softmax multiplies it back: undo the division, there is no such softmax here.
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        cu, longest = packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q
        if dropout and not self.config.sequence_parallel:  # the parent's RNG discipline for attention dropout
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = packed_causal_attention(query, key, value, cu, scale=scale, dropout=dropout, max_len=longest)
        else:
            out = packed_causal_attention(query, key, value, cu, scale=scale, dropout=dropout, max_len=longest)
        return out.reshape(out.shape[0], -1)  # (T, heads/tp * dim); Attention adds the batch dim back


def packed_seq_params(lens: list[int], padded: list[int], device):
    """THD params of one packed row: true and padded sequence lengths (equal without context parallel)."""
    # Built on the host, copied without blocking: no host sync per micro-batch.
    cu = to_device(torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32), torch.device(device))
    cu_padded = to_device(torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                          torch.device(device))
    longest = max(padded)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest)
