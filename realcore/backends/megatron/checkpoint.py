"""HF checkpoints on a running Megatron mesh: each rank reads only its own shard of an HF
directory, and rank 0 gathers every shard back into one HF state dict (to save or to push).

A "stage" is a virtual pipeline stage: with `v` model chunks per PP rank, chunk `c` of PP rank
`p` is stage `c * pp + p` of `v * pp` (Megatron's interleaved placement), so `convert.py`'s
even split over `pp * v` stages gives each chunk its layers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor

from realcore.backends.device import group_device
from realcore.backends.megatron.convert import hf_to_mcore, mcore_to_hf


class LazyHFState(Mapping):
    """An HF safetensors checkpoint (single file or sharded with an index) read tensor by tensor,
    so a rank loads only what its shard needs."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self._files = {}
        for name in files:
            handle = safe_open(os.path.join(path, name), framework="pt")
            for key in handle.keys():
                self._files[key] = handle

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._files:
            raise KeyError(f"HF checkpoint has no tensor {key!r}")
        return self._files[key].get_tensor(key).float()

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def meta(self) -> dict[str, Tensor]:
        """Shapes only (meta tensors): enough to compute every shard's layout."""
        out = {}
        for key, handle in self._files.items():
            shape = handle.get_slice(key).get_shape()
            out[key] = torch.empty(shape, dtype=torch.float32, device="meta")
        return out


def load_shard(hf_state: Mapping, hf_config, *, tp: int, n_stages: int, tp_rank: int, stage: int,
               ep: int = 1, ep_rank: int = 0, head: str = "policy") -> dict[str, Tensor]:
    return hf_to_mcore(hf_state, hf_config, tp=tp, pp=n_stages, tp_rank=tp_rank, pp_rank=stage, ep=ep, ep_rank=ep_rank,
                       head=head)


def _is_expert(key: str) -> bool:
    return ".mlp.experts." in key


def gather_hf(local: dict[int, dict[str, Tensor]], meta: dict[str, Tensor], hf_config, *, tp: int, pp: int,
              n_stages: int, coords: tuple[int, int, int, int], ep: int = 1, group=None,
              head: str = "policy") -> dict[str, Tensor] | None:
    """Collective over the mesh: rank 0 of `group` returns the HF state dict (float32, on the CPU),
    others None. Messages travel on the device of the group's backend (NCCL: this rank's GPU).

    local: this rank's tensors by stage (its model chunks' state dicts or grads, HF-convertible keys);
    coords: this rank's (tp_rank, pp_rank, replica, ep_rank); dense tensors come from replica 0,
    each EP rank's experts from the first rank holding them; meta: `LazyHFState.meta()` (with a
    value/score head: `heads.head_meta`, the layout of the head's `score.*`).
    """
    me = dist.get_rank(group)
    device = group_device(group)
    mine = torch.tensor(list(coords), dtype=torch.int64).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    table = [tuple(x.tolist()) for x in everyone]
    dense_owner = {(t, p): r for r, (t, p, rep, _) in enumerate(table) if rep == 0}
    expert_owner: dict[tuple[int, int], int] = {}
    for r, (_, p, _, e) in enumerate(table):
        expert_owner.setdefault((p, e), r)

    def layout(t: int, stage: int, e: int) -> dict[str, Tensor]:
        return hf_to_mcore(meta, hf_config, tp=tp, pp=n_stages, tp_rank=t, pp_rank=stage, ep=ep, ep_rank=e, head=head)

    shards: dict[tuple[int, int], dict[str, Tensor]] = {}
    for t in range(tp):
        for stage in range(n_stages):
            dense = {k: v for k, v in layout(t, stage, 0).items() if not _is_expert(k)}
            got = _collect(local, stage, dense, dense_owner[(t, stage % pp)], me, group, device)
            if got is not None:
                shards[(t, stage)] = got
    for stage in range(n_stages):
        for e in range(ep):
            experts = {k: v for k, v in layout(0, stage, e).items() if _is_expert(k)}
            if not experts:
                break  # a dense model
            got = _collect(local, stage, experts, expert_owner[(stage % pp, e)], me, group, device)
            if got is not None:  # local expert j of EP rank e is global expert e * per + j
                per = len({k.split("local_experts.")[1].split(".")[0] for k in experts})
                shards[(0, stage)].update({_renumber(k, e * per): v for k, v in got.items()})
    if me != 0:
        return None
    return mcore_to_hf(shards, hf_config, tp=tp, pp=n_stages, head=head)


def _renumber(key: str, offset: int) -> str:
    head, tail = key.split("local_experts.")
    j, rest = tail.split(".", 1)
    return f"{head}local_experts.{int(j) + offset}.{rest}"


def _collect(local, stage: int, layout: dict[str, Tensor], src: int, me: int, group,
             device: torch.device) -> dict[str, Tensor] | None:
    """Rank 0 gets `layout`'s tensors of `stage` from rank `src` (one flat message on `device`), on
    the CPU; None elsewhere."""
    keys = sorted(layout)
    if src == me:
        if me == 0:
            return {k: local[stage][k].detach().to("cpu", torch.float32, copy=True) for k in keys}
        flat = torch.cat([local[stage][k].detach().to(device, torch.float32).reshape(-1) for k in keys])
        dist.send(flat, dst=_global(0, group), group=group)
        return None
    if me != 0:
        return None
    flat = torch.empty(sum(layout[k].numel() for k in keys), dtype=torch.float32, device=device)
    dist.recv(flat, src=_global(src, group), group=group)
    flat = flat.cpu()
    return {k: p.view(layout[k].shape) for k, p in zip(keys, flat.split([layout[k].numel() for k in keys]))}


def _global(rank: int, group) -> int:
    """dist.send/recv take global ranks even with a group."""
    return rank if group is None else dist.get_global_rank(group, rank)
