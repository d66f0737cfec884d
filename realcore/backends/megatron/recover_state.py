"""Recover state of a trainable Megatron role: everything it needs to continue training exactly.

Layout written under the caller's (empty) directory:

    dist_ckpt/    a megatron.core.dist_checkpointing checkpoint (torch_dist format) of
                    model{v}    model chunk v's `sharded_state_dict()` (global layer numbering)
                    optimizer   `optimizer.sharded_state_dict(...)`: Adam moments and step; the distributed
                                optimizer writes its DP shards in Megatron's 'dp_reshardable' format
                    rng         one object per global rank: the torch CPU generator (and the CUDA one on
                                GPUs) and Megatron's tensor-parallel RNG tracker states
    engine.json   {"format": 1, "version": completed optimizer steps, "mesh": {...}}, written last by
                  global rank 0; the learning rate is not stored, it follows from `version`.

A checkpoint loads only on the mesh that wrote it (same dp/pp/tp/cp/ep, virtual stages and
optimizer kind): per-rank RNG streams and the distributed optimizer's buffer layout do not map
onto another mesh, and recovery must be exact. Another mesh is one ValueError naming both.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
from multiprocessing.managers import SyncManager

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer import distrib_optimizer
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from realcore.backends.megatron.cpu_compat import cuda_to_cpu_mode

FORMAT = 1
# Megatron-LM's default for the distributed optimizer: each DP rank writes and reads its own shard.
_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _die_with_parent() -> None:
    """In the results queue's manager process: the kernel kills it when its model worker dies."""
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _results_queue():
    """dist_checkpointing collects write results through a queue served by a manager process that
    outlives every save. Megatron starts it with nothing tying it to its parent: a SIGKILLed model
    worker would leave it behind forever. Ours dies with its worker. It is forked where there is
    no CUDA: spawning it imports torch again (seconds per rank), and forking is only unsafe once
    CUDA is initialised."""
    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn" if torch.cuda.is_available() else "fork"))
        manager.start(initializer=_die_with_parent)
        filesystem_async._results_queue = manager.Queue()
    return filesystem_async._results_queue


def save(path: str, chunks: list, optimizer, *, version: int, mesh: dict) -> None:
    """Collective over the mesh: write the recover state of `chunks` (DDP-wrapped) and `optimizer`."""
    filesystem_async._get_write_results_queue = _results_queue
    ckpt = os.path.join(path, "dist_ckpt")
    if dist.get_rank() == 0:
        os.makedirs(ckpt)
    dist.barrier()
    with cuda_to_cpu_mode():
        dist_checkpointing.save(_sharded_state(chunks, optimizer, _rng_state(), is_loading=False), ckpt)
    if dist.get_rank() == 0:
        with open(os.path.join(path, "engine.json"), "w") as f:
            json.dump({"format": FORMAT, "version": version, "mesh": mesh}, f)
    dist.barrier()


def load(path: str, chunks: list, optimizer, *, mesh: dict) -> int:
    """Collective over the mesh: restore what `save` wrote into fresh `chunks` and `optimizer`;
    returns the saved version."""
    meta = _read_meta(path, mesh)
    _init_torch_adam_state(optimizer)
    # no_grad: with fp32 weights the distributed optimizer's main params are views of the model's.
    with cuda_to_cpu_mode(), torch.no_grad():
        state = _sharded_state(chunks, optimizer, _rng_state(), is_loading=True)
        loaded = dist_checkpointing.load(state, os.path.join(path, "dist_ckpt"))
        for v, c in enumerate(chunks):
            c.module.load_state_dict(loaded[f"model{v}"])
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_torch_adam_step(optimizer)
    _set_rng_state(loaded["rng"])
    return meta["version"]


def _torch_adam_optimizers(optimizer) -> list:
    """The distributed optimizers of `optimizer` that run torch's Adam (no Apex/TE, as always on CPU)."""
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    return [opt for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(opt, distrib_optimizer.DistributedOptimizer)]


# Two Megatron bugs of the DistributedOptimizer over torch's Adam: building the sharded state dict
# asserts a `step` in the Adam state, which a fresh optimizer lacks; and loading the 'dp_reshardable'
# format copies that pre-load `step` back over the loaded one (the true step is in the loaded param
# groups). Zero moments at step 0 stand in before the load; the steps are set from the groups after.
def _init_torch_adam_state(optimizer) -> None:
    for opt in _torch_adam_optimizers(optimizer):
        if not opt.optimizer.state:
            opt.init_state_fn(opt.optimizer, opt.config)
            for s in opt.optimizer.state.values():
                s["step"] = torch.tensor(0.0)


def _restore_torch_adam_step(optimizer) -> None:
    for opt in _torch_adam_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                opt.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


def _read_meta(path: str, mesh: dict) -> dict:
    meta_path = os.path.join(path, "engine.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"megatron recover state: {path} has no engine.json (not a complete recover checkpoint)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"megatron recover state: {path} has format {meta.get('format')}, this code reads {FORMAT}")
    if meta["mesh"] != mesh:
        raise ValueError(f"megatron recover state: {path} was written on mesh {_describe(meta['mesh'])}, "
                         f"this role runs on {_describe(mesh)}; recovery needs the same mesh")
    return meta


def _describe(mesh: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in mesh.items())


def _sharded_state(chunks: list, optimizer, rng: dict, *, is_loading: bool) -> dict:
    """The sharded state dict Megatron-LM builds (`generate_state_dict`), plus this rank's RNG."""
    # The GPT models inside the DDP wrappers: their parameters are the ones the optimizer holds.
    state = {f"model{v}": c.module.sharded_state_dict(metadata=_METADATA) for v, c in enumerate(chunks)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_METADATA)
    state["rng"] = ShardedObject("rng", rng, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)
    return state


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    """Restore _rng_state's (generator states are CPU byte tensors, wherever a load put them). The
    CUDA generator's is restored on a GPU only (a CPU run's checkpoint has none)."""
    torch.set_rng_state(state["cpu"].cpu())
    get_cuda_rng_tracker().set_states({name: t.cpu() for name, t in state["tracker"].items()})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
