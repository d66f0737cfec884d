"""The consistency figures of one training call (issue 44, part 8): how far the sampler's behaviour
log-probs are from the trainer's recomputed ones over the trained tokens, and how many policy versions
the trained sequences span. realcore/trainer/consistency.py turns them into warnings."""

from __future__ import annotations

from typing import Any


def consistency_stats(gaps: list, versions: dict[str, list], model: Any) -> dict[str, float]:
    """gaps: 1-D tensors of |behav - recomputed| per trained token (None or empty: no figure); versions:
    `version_start` / `version_end` per sequence when the batch holds them (async mode).

    The figures cover every data-parallel rank of the role when its engine exposes its torch.distributed
    `group` (torch, fsdp): sums and maxima are all-reduced, so every rank reports the same numbers and the
    master's mean over workers keeps them. Without it (one rank, or megatron) they are the rank's own; the
    p99 over ranks is then the ranks' mean, and across ranks in the all-reduced case the largest rank p99
    (an upper bound of the whole batch's)."""
    import torch  # the master imports the MFCs without torch
    import torch.distributed as dist

    out: dict[str, float] = {}
    g = torch.cat([x.cpu() for x in gaps]).double() if gaps else torch.zeros(0, dtype=torch.float64)
    has_versions = "version_start" in versions and "version_end" in versions
    vs = torch.cat(versions["version_start"]).double() if has_versions and versions["version_start"] else None
    ve = torch.cat(versions["version_end"]).double() if has_versions and versions["version_end"] else None
    inf = float("inf")
    # [sum, count] summed; [p99, max, -min start, max end] maxed over ranks
    sums = torch.tensor([float(g.sum()), float(g.numel())], dtype=torch.float64)
    maxes = torch.tensor([
        _p99(g), float(g.max()) if g.numel() else 0.0,
        -float(vs.min()) if vs is not None and vs.numel() else -inf, float(ve.max()) if ve is not None and ve.numel() else -inf,
    ], dtype=torch.float64)
    group = getattr(model, "group", None)
    if group is not None and getattr(model, "world_size", 1) > 1 and dist.is_available() and dist.is_initialized():
        dev = getattr(model, "comm_device", torch.device("cpu"))
        s, m = sums.to(dev), maxes.to(dev)
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        sums, maxes = s.cpu(), m.cpu()
    if sums[1] > 0:
        out["consistency/logprob_gap_mean"] = float(sums[0] / sums[1])
        out["consistency/logprob_gap_p99"] = float(maxes[0])
        out["consistency/logprob_gap_max"] = float(maxes[1])
    if has_versions and maxes[3] > -inf:
        out["consistency/version_span"] = float(maxes[3] + maxes[2])  # a float: the master sums int stats over workers
    return out


def _p99(x):
    """The nearest-rank 99th percentile (torch.quantile refuses more than 2^24 values)."""
    import math

    if x.numel() == 0:
        return 0.0
    return float(x.kthvalue(max(1, math.ceil(0.99 * x.numel()))).values)
