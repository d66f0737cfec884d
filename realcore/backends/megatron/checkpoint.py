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
from torch import Tensor

from realcore.backends.megatron.convert import hf_to_mcore, mcore_to_hf


class LazyHFState(Mapping):
    """An HF safetensors checkpoint (single file or sharded with an index) read tensor by tensor,
    so a rank loads only what its shard needs."""

    def __init__(self, path: str):
        from safetensors import safe_open

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
               ep: int = 1, ep_rank: int = 0) -> dict[str, Tensor]:
    return hf_to_mcore(hf_state, hf_config, tp=tp, pp=n_stages, tp_rank=tp_rank, pp_rank=stage)


def gather_hf(local: dict[int, dict[str, Tensor]], meta: dict[str, Tensor], hf_config, *, tp: int, pp: int,
              n_stages: int, coords: tuple[int, int, int], ep: int = 1, ep_rank: int = 0,
              group=None) -> dict[str, Tensor] | None:
    """Collective over the mesh: rank 0 of `group` returns the HF state dict, others None.

    local: this rank's shards by stage (its model chunks' state dicts, `_extra_state` removed);
    coords: this rank's (tp_rank, pp_rank, replica) where replica 0 holds the copies sent (the
    first data/context-parallel replica); meta: the HF layout (`LazyHFState.meta()`).
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    mine = torch.tensor(list(coords), dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    owner = {(int(t), int(p)): r for r, (t, p, rep) in enumerate(x.tolist() for x in everyone) if rep == 0}
    shards: dict[tuple[int, int], dict[str, Tensor]] = {}
    for t in range(tp):
        for stage in range(n_stages):
            src = owner[(t, stage % pp)]
            if src != me and me != 0:
                continue
            layout = hf_to_mcore(meta, hf_config, tp=tp, pp=n_stages, tp_rank=t, pp_rank=stage)
            keys = sorted(layout)
            if src == me:
                tensors = [local[stage][k].detach().float().reshape(-1) for k in keys]
                if me == 0:
                    shards[(t, stage)] = {k: v.detach().float().clone() for k, v in local[stage].items() if k in layout}
                    continue
                dist.send(torch.cat(tensors), dst=_global(src_rank=0, group=group), group=group)
                continue
            flat = torch.empty(sum(layout[k].numel() for k in keys), dtype=torch.float32)
            dist.recv(flat, src=_global(src, group), group=group)
            parts = flat.split([layout[k].numel() for k in keys])
            shards[(t, stage)] = {k: p.view(layout[k].shape) for k, p in zip(keys, parts)}
    if me != 0:
        return None
    return mcore_to_hf(shards, hf_config, tp=tp, pp=n_stages)


def _global(src_rank: int, group) -> int:
    """dist.send/recv take global ranks even with a group."""
    return src_rank if group is None else dist.get_global_rank(group, src_rank)
