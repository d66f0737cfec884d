"""Context parallelism for packed micro-batches (GPU only: Megatron runs CP through
TransformerEngine's attention; on CPU the launcher refuses CP > 1).

Each sequence is padded to a multiple of 2 * cp and cut into 2 * cp chunks; CP rank r keeps
chunks r and 2*cp-1-r (the load-balanced "zigzag" split TransformerEngine expects for causal
attention). Attention gets the THD layout: `PackedSeqParams` with the true and padded
cumulative lengths. Each rank computes the next-token log-prob of its own positions; an
all-gather (whose backward keeps the rank's slice: every rank then computes the same full loss)
rebuilds them in row order.

NOTE: written against megatron-core 0.16 + TransformerEngine but never run on this project's
CPU machines; `tests/test_megatron_cp_gpu.py` checks it against a reference on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def zigzag_layout(lens: list[int], cp: int, cp_rank: int) -> tuple[list[int], torch.Tensor]:
    """(padded lengths, indices of this rank's positions in the padded packed row)."""
    padded = [-(-n // (2 * cp)) * (2 * cp) for n in lens]
    idx, start = [], 0
    for n in padded:
        c = n // (2 * cp)
        for chunk in (cp_rank, 2 * cp - 1 - cp_rank):
            idx.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
        start += n
    return padded, torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)


class GatherRow(torch.autograd.Function):
    """All-gather per-position values of the CP ranks into the full padded row (forward); the
    backward keeps this rank's positions (all ranks compute the same loss from the full row)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, idx: torch.Tensor, total: int, group):
        ctx.save_for_backward(idx)
        world = dist.get_world_size(group)
        pieces = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        all_idx = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(all_idx, idx.contiguous(), group=group)
        row = local.new_zeros(total)
        row[torch.cat(all_idx)] = torch.cat(pieces)
        return row

    @staticmethod
    def backward(ctx, grad_row):
        (idx,) = ctx.saved_tensors
        return grad_row[idx], None, None, None


def unpad(row: torch.Tensor, lens: list[int], padded: list[int]) -> torch.Tensor:
    """The real tokens' values of a padded packed row, in order."""
    parts, start = [], 0
    for n, p in zip(lens, padded):
        parts.append(row[start:start + n])
        start += p
    return torch.cat(parts)
