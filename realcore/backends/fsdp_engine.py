"""FSDPEngine: the torch engine with parameters, gradients and optimizer state sharded over the
data-parallel group by FSDP2 (`backend: fsdp`). Same micro-batching, losses and stats as
TorchEngine; what differs:

- Each rank holds 1/N of every parameter (a DTensor) and of AdamW's state; a transformer block's
  parameters are all-gathered for its forward and backward, its gradients reduce-scattered (summed:
  each micro-batch's loss is already scaled by its share of the global token count).
- Every forward gathers collectively, so every rank runs the same number of passes: a rank with
  fewer micro-batches adds idle ones (zero gradients).
- dtype=bfloat16 gathers the parameters in bf16 and reduces gradients in fp32 (MixedPrecisionPolicy);
  the sharded fp32 parameters are the optimizer's master copy.
- save_hf / hf_state_dict gather the full weights to rank 0 (collective); save_state writes each
  rank's own shards, so a run resumes on the same data-parallel size.
- No generation here (one rank decoding alone would hang the others' gathers): fsdp roles sample
  on generation servers.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from realcore.api.engine import GenerationResult
from realcore.backends.fsdp import apply_ac, apply_fsdp
from realcore.backends.torch_engine import TorchEngine


class FSDPEngine(TorchEngine):
    """One data-parallel rank of a model role whose parameters are sharded over the group."""

    def _parallelize(self) -> None:
        if not self.distributed:
            raise ValueError("backend=fsdp needs torch.distributed initialised (the training mesh of a run)")
        if self.role.gradient_checkpointing:  # before sharding: the FSDP unit wraps the checkpointed block
            apply_ac(self.model)
        # The model is still on the CPU: fully_shard moves each unit to the mesh's device as it shards
        # it, so a GPU never holds more than the shards plus one whole unit.
        mesh = DeviceMesh.from_group(self.group, self.device.type)
        apply_fsdp(self.model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32))
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum over ranks, as TorchEngine does
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)

    def _autocast(self):
        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts the gathered parameters instead

    def _idle_passes(self, n_passes: int) -> int:
        n = torch.tensor([n_passes], dtype=torch.int64, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        return int(n) - n_passes

    def _reduce_grads(self) -> None:
        pass  # FSDP reduce-scattered every micro-batch's gradients in its backward

    def generate(self, prompts: list[list[int]], gconfig) -> list[GenerationResult]:
        raise NotImplementedError("fsdp roles generate through generation servers (allocation_mode local.dN+...)")

    # ---- weights and state ----

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full state dict in HF names on rank 0 (CPU, float32), None elsewhere."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.rank == 0 else None

    def save_hf(self, path: str) -> None:
        """Collective: every rank sends its shards, rank 0 writes the HF directory atomically."""
        state = self.hf_state_dict()
        if state is not None:
            self._write_hf(os.path.abspath(path), state)

    def save_state(self, path: str) -> None:
        """This rank's shards of the weights and optimizer state, with the schedule, version and RNG."""
        if self.optimizer is not None:
            model, optim = get_state_dict(self.model, self.optimizer)
        else:
            model, optim = get_model_state_dict(self.model), None
        torch.save({
            "model": _local(model), "optimizer": _local(optim),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "version": self.version, "rng": torch.get_rng_state(), "dp": [self.rank, self.world_size],
        }, os.path.join(path, "engine.pt"))

    def load_state(self, path: str) -> None:
        state = torch.load(os.path.join(path, "engine.pt"), map_location=self.device, weights_only=True)
        if state["dp"] != [self.rank, self.world_size]:
            raise ValueError(f"load_state: {path} holds the shards of data-parallel rank {state['dp'][0]} of "
                             f"{state['dp'][1]}, this is rank {self.rank} of {self.world_size} (resume on the same mesh)")
        # The live state dicts give every shard's layout (mesh, placement, global shape).
        if self.optimizer is not None:
            model, optim = get_state_dict(self.model, self.optimizer)  # creates AdamW's state if none yet
            set_state_dict(self.model, self.optimizer, model_state_dict=_like(state["model"], model),
                           optim_state_dict=_like(state["optimizer"], optim))
            self.scheduler.load_state_dict(state["scheduler"])
        else:
            set_model_state_dict(self.model, _like(state["model"], get_model_state_dict(self.model)))
        self.version = state["version"]
        torch.set_rng_state(state["rng"])


def _local(tree):
    """DTensors -> this rank's plain shards, through dicts and lists (what torch.load reads safely)."""
    if isinstance(tree, DTensor):
        return tree.to_local().clone()
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(v) for v in tree)
    return tree


def _like(saved, template):
    """Inverse of _local: a saved shard becomes a DTensor laid out as the live `template` one."""
    if isinstance(template, DTensor):
        return DTensor.from_local(saved.to(template.device), template.device_mesh, template.placements,
                                  shape=template.shape, stride=template.stride())
    if isinstance(saved, dict):
        template = template if isinstance(template, dict) else {}
        return {k: _like(v, template.get(k)) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        template = template if isinstance(template, (list, tuple)) else [None] * len(saved)
        return type(saved)(_like(v, t) for v, t in zip(saved, template))
    return saved
