"""A preallocated KV cache for the built-in engine: one slot (row) per running request, written in place.

Layout: per layer, keys and values of shape (slots, kv_heads, capacity, head_dim), on the engine's
device (a CPU or a GPU) in the model's dtype. Row i of the
running batch lives in slot i, its token at position p in column p (no padding on the left), so
a decode step writes one column per row and attends over a view of the first `width` columns:
no concatenation and no copy of the cache per step (what `DynamicCache` costs). Running rows are
kept in slots 0..B-1 (a finished row's slot takes the last row's contents), so that view is a
plain slice. Capacity grows (one copy) when a row outgrows it, by half again, so a long request
pays for its own memory only.

It is handed to an HF model as `past_key_values`: HF attention layers call
`update(keys, values, layer_idx)` and attend over what it returns, with the 4D mask the engine
passes (HF uses a 4D mask as given).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

_ROUND = 64  # capacity grows in multiples of this many positions


class SlotKVCache:
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.n_layers = n_layers
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots, self.capacity = 0, 0
        self._rows: torch.Tensor | None = None  # decode: (B,) slot of each row
        self._pos: torch.Tensor | None = None  # decode: (B,) column the new token goes to
        self._width = 0  # decode: columns attended over

    def reserve(self, slots: int, length: int, live: tuple[int, int]) -> None:
        """Make room for `slots` rows of `length` positions, keeping the first live=(rows, columns)."""
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots = max(slots, self.slots)
        new_cap = self.capacity if length <= self.capacity else -(-max(length, self.capacity * 3 // 2) // _ROUND) * _ROUND
        # Zeros, not empty: masked columns still enter attention (weight 0), and 0 * NaN garbage is NaN.
        alloc = lambda: torch.zeros(new_slots, *self.shape[:1], new_cap, self.shape[1],  # noqa: E731
                                    dtype=self.dtype, device=self.device)
        rows, cols = min(live[0], self.slots), min(live[1], self.capacity)
        for layer in range(self.n_layers):
            for store in (self.keys, self.values):
                new = alloc()
                if rows and cols:
                    new[:rows, :, :cols] = store[layer][:rows, :, :cols]
                if layer < len(store):
                    store[layer] = new
                else:
                    store.append(new)
        self.slots, self.capacity = new_slots, new_cap

    def release(self) -> None:
        """Free the buffers (the engine is idle)."""
        self.keys, self.values, self.slots, self.capacity = [], [], 0, 0

    def write_prefill(self, first_slot: int, layers, lengths: list[int], rows: list[int] | None = None) -> None:
        """Copy a left-padded prefill's keys/values (HF cache layers of (U, H, L, D)) into slots
        first_slot.. : slot first_slot + i gets row rows[i] (default i), its real tokens (its last
        lengths[i] columns) in columns 0..lengths[i]-1. Rows may repeat: requests that share a
        sequence share its prefill."""
        rows = range(len(lengths)) if rows is None else rows
        for layer, src in enumerate(layers):
            for i, (row, n) in enumerate(zip(rows, lengths)):
                self.keys[layer][first_slot + i, :, :n] = src.keys[row, :, src.keys.shape[2] - n :]
                self.values[layer][first_slot + i, :, :n] = src.values[row, :, src.values.shape[2] - n :]

    def move(self, src: int, dst: int, columns: int) -> None:
        """Slot `src`'s first `columns` positions into slot `dst` (a finished row's slot is reused)."""
        for store in (self.keys, self.values):
            for t in store:
                t[dst, :, :columns] = t[src, :, :columns]

    def begin_decode(self, pos: torch.Tensor, width: int) -> None:
        """The next forward writes row i's token at column pos[i] and attends over `width` columns."""
        assert width <= self.capacity and len(pos) <= self.slots
        self._rows = torch.arange(len(pos), device=self.device)
        self._pos, self._width = pos, width

    # --- what an HF attention layer calls ---------------------------------------------------------

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """keys/values: (B, H, 1, D) of the new tokens -> the rows' (B, H, width, D) views."""
        B = keys.shape[0]
        self.keys[layer_idx][self._rows, :, self._pos] = keys[:, :, 0]
        self.values[layer_idx][self._rows, :, self._pos] = values[:, :, 0]
        return self.keys[layer_idx][:B, :, : self._width], self.values[layer_idx][:B, :, : self._width]


# --- decode attention ------------------------------------------------------------------------------

ATTENTION = "realcore_slot_decode"


def slot_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """One new token per row over its slot: query (B, H, 1, D), key/value (B, Hkv, W, D) views of
    the cache, attention_mask (B, 1, 1, W) additive -> (B, 1, H, D), None.

    Why not transformers' sdpa: with a mask it repeats every key/value head for its query heads
    (a copy of the cache per layer and step) and runs a flash kernel made for long queries; two
    batched matmuls per kv head group cost a third of that here. Scores and softmax in float32
    whatever the cache's dtype (bf16 cache: no bf16 rounding of the scores); on a GPU with a bf16
    cache that is a float32 copy of the attended keys and values per layer and step (not measured
    on a GPU yet; a fused kernel reading bf16 would avoid it)."""
    B, H, _, D = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else D**-0.5
    q = query.float().view(B, kv_heads, H // kv_heads, D)  # head h = kv * group + g, as repeat_kv orders them
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # (B, Hkv, G, W)
    scores = scores + attention_mask.float().view(B, 1, 1, width)
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float())  # (B, Hkv, G, D)
    return out.to(query.dtype).view(B, H, 1, D).transpose(1, 2), None


def register_attention() -> None:
    AttentionInterface.register(ATTENTION, slot_decode_attention)
