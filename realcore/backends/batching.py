"""Backend-neutral training helpers: micro-batching by token budget, packed-sequence masks,
per-token log-probs, the LR schedule, and stat reduction over ranks. Shared by the torch and
Megatron engines so both train on exactly the same micro-batches and losses."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from realcore.api.config import OptimizerConfig
from realcore.backends.logprobs import logprobs_and_entropy


def lr_factor(step: int, opt: OptimizerConfig, total_steps: int) -> float:
    """Multiplier of `opt.lr` for optimizer step `step` (0-based): linear warm-up over
    `warmup_steps`, then cosine decay to `min_lr_ratio` at `total_steps` (or constant)."""
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.lr_scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - opt.warmup_steps) / max(1, total_steps - opt.warmup_steps))
    return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _units(n_seqs: int, group_sizes: list[int] | None) -> list[range]:
    """The indivisible runs of sequence indices: each sequence, or each group of `group_sizes`."""
    sizes = group_sizes if group_sizes is not None else [1] * n_seqs
    if sum(sizes) != n_seqs or any(g < 1 for g in sizes):
        raise ValueError(f"group_sizes {sizes} do not cover the {n_seqs} sequences")
    starts = [0]
    for g in sizes:
        starts.append(starts[-1] + g)
    return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]


def split_by_budget(lens: list[int], budget: int, group_sizes: list[int] | None = None) -> list[list[int]]:
    """Greedy, in-order split of sequence indices into micro-batches of at most `budget` tokens
    (a sequence longer than the budget gets a micro-batch of its own). With `group_sizes` the
    sequences of one group stay in one micro-batch (a group over the budget gets one of its own):
    a loss over a whole group (DPO's pairs, GSPO's groups) then sees all of it."""
    if budget <= 0:
        raise ValueError(f"max_tokens_per_mb must be > 0, got {budget}")
    mbs: list[list[int]] = []
    cur: list[int] = []
    cur_tokens = 0
    for unit in _units(len(lens), group_sizes):
        n = sum(lens[i] for i in unit)
        if cur and cur_tokens + n > budget:
            mbs.append(cur)
            cur, cur_tokens = [], 0
        cur.extend(unit)
        cur_tokens += n
    if cur:
        mbs.append(cur)
    return mbs


def split_minibatches(n_seqs: int, n_minibatches: int, group_sizes: list[int] | None = None) -> list[range]:
    """`n_minibatches` contiguous chunks whose sizes differ by at most one sequence, or one group
    with `group_sizes` (some may be empty)."""
    units = _units(n_seqs, group_sizes)
    q, r = divmod(len(units), n_minibatches)
    bounds = [0]
    for i in range(n_minibatches):
        bounds.append(bounds[-1] + q + (i < r))
    return [range(units[a].start, units[b - 1].stop) if b > a else range(0) for a, b in zip(bounds[:-1], bounds[1:])]


def groups_within(chunk: range, group_sizes: list[int] | None) -> list[int] | None:
    """The group sizes of the sequences in `chunk` (a split_minibatches chunk: whole groups)."""
    if group_sizes is None:
        return None
    return [len(u) for u in _units(sum(group_sizes), group_sizes) if u.start >= chunk.start and u.stop <= chunk.stop]


def cu_seqlens(lens: list[int], device=None) -> torch.Tensor:
    """(n + 1,) int32 offsets of packed sequences: sequence i is tokens [cu[i], cu[i + 1]) of the row,
    the form varlen attention kernels take, and how a loss function finds sequence boundaries."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.tensor(lens, dtype=torch.int32, device=device).cumsum(0)
    return out


def train_batch(engine, data: dict[str, list[torch.Tensor]], loss_fn, loss_weight_fn, *, n_minibatches: int = 1,
                temperature: float = 1.0, max_tokens_per_mb: int | None = None,
                group_sizes: list[int] | None = None) -> dict[str, float]:
    """Engine.train_batch of every backend: one optimizer step per minibatch (`engine._train_minibatch`
    accumulates over micro-batches and ranks), the stats averaged over the minibatches."""
    if engine.optimizer is None:
        raise ValueError("train_batch: this model role is not trainable (role.trainable is False)")
    lens = check_train_data(data)
    results = []
    for chunk in split_minibatches(len(lens), n_minibatches, group_sizes):
        mb_data = {k: [v[i] for i in chunk] for k, v in data.items()}
        results.append(engine._train_minibatch(mb_data, loss_fn, loss_weight_fn, temperature, max_tokens_per_mb,
                                               groups_within(chunk, group_sizes)))
    return mean_over_minibatches(results)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, starts: torch.Tensor, temperature: float,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(x[t] | x[:t]) and entropy of the temperature-scaled distribution, aligned
    with `ids` (realcore.api.data); 0 where `starts` marks the first token of a sequence.
    logits: (T, V), ids: (T,), starts: (T,) bool."""
    # Row t predicts ids[t + 1]; the last row's label is a dummy (its result is dropped).
    lp, ent = logprobs_and_entropy(logits, torch.roll(ids, -1), temperature, with_entropy)
    # Position `start` would be predicted by the previous sequence's last token: not a real token.
    lp = torch.where(starts, 0.0, torch.cat([lp.new_zeros(1), lp[:-1]]))
    if ent is not None:
        ent = torch.where(starts, 0.0, torch.cat([ent.new_zeros(1), ent[:-1]]))
    return lp, ent


def union_keys(keys: list[str], group, device) -> list[str]:
    """Sorted union of stat names over the group (a rank with an empty minibatch has none).
    Names travel as padded UTF-8 byte tensors on `device` (the group backend's: device.group_device):
    no pickle."""
    raw = "\n".join(sorted(keys)).encode("utf-8")
    n = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    buf = torch.zeros(int(n) + 1, dtype=torch.uint8, device=device)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, buf, group=group)
    names = {k for t in out for k in bytes(t.tolist()).rstrip(b"\0").decode("utf-8").split("\n") if k}
    return sorted(names)


def check_train_data(data: dict[str, list[torch.Tensor]]) -> list[int]:
    """Sequence lengths of a train_batch input; ValueError unless every key is per-token or
    per-sequence (one element per sequence while some input_ids are longer: packed as (n_seqs,))."""
    if "input_ids" not in data:
        raise ValueError(f"train_batch: data must hold 'input_ids', got keys {sorted(data)}")
    lens = [int(x.numel()) for x in data["input_ids"]]
    for k, seqs in data.items():
        if len(seqs) != len(lens):
            raise ValueError(f"train_batch: key {k!r} has {len(seqs)} sequences, input_ids {len(lens)}")
        sizes = [int(t.numel()) for t in seqs]
        if sizes != lens and any(n != 1 for n in sizes):
            raise ValueError(f"train_batch: key {k!r} is neither per-token (lengths of input_ids) nor "
                             "per-sequence (one element each)")
    return lens


def pack(data: dict[str, list[torch.Tensor]], idx: list[int]) -> dict[str, torch.Tensor]:
    """The sequences `idx` of every key concatenated: per-token keys to (n_tokens,), per-sequence
    keys to (n_seqs,); plus `cu_seqlens`, the sequences' boundaries (what a loss function reads)."""
    packed = {k: torch.cat([v[i].reshape(-1) for i in idx]) for k, v in data.items()}
    packed["cu_seqlens"] = cu_seqlens([int(data["input_ids"][i].numel()) for i in idx])
    return packed


def shift_head(h: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """A value head's per-position outputs (T,) -> values aligned with the ids (realcore.api.data):
    values[t] = h[t - 1], the head after reading x[:t]; 0 where `starts` marks a sequence's first token."""
    return torch.where(starts, 0.0, torch.cat([h.new_zeros(1), h[:-1]]))


def mean_over_minibatches(results: list[dict[str, float]]) -> dict[str, float]:
    """Each stat averaged over the minibatches that report it."""
    keys = {k for r in results for k in r}
    return {k: sum(r[k] for r in results if k in r) / sum(k in r for r in results) for k in sorted(keys)}


def reduce_weighted(sums: dict[str, float | torch.Tensor], weights: dict[str, float], group, world_size: int,
                    device=None) -> dict[str, float]:
    """sum(w * stat) / sum(w) per stat name over the ranks of `group` (keys may differ by rank).
    `sums`: numbers, or scalar tensors left on the compute device (they are read in one copy, not one
    host sync each); `device`: where the collective's tensors live (the group backend's; None: CPU)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    keys = sorted(sums) if world_size == 1 else union_keys(list(sums), group, device)
    if not keys:
        return {}
    s = torch.stack([stat_on(sums[k], device) if k in sums else torch.zeros((), dtype=torch.float64, device=device)
                     for k in keys])  # (n_keys,)
    w = [weights.get(k, 0.0) for k in keys]
    if world_size > 1:
        vec = torch.cat([s, torch.tensor(w, dtype=torch.float64).to(device)])  # (2 * n_keys,)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
        s_host, w = vec[: len(keys)].tolist(), vec[len(keys):].tolist()
    else:
        s_host = s.tolist()
    return {k: (sk / wk if wk > 0 else 0.0) for k, sk, wk in zip(keys, s_host, w)}


def stat_on(v: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A loss statistic (a tensor, or a number) as a float64 scalar on `device`, without reading it."""
    if torch.is_tensor(v):
        return v.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(v), dtype=torch.float64).to(device)
