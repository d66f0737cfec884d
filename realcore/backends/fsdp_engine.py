"""FSDPEngine: the torch engine with parameters, gradients and optimizer state sharded over the
data-parallel group by FSDP2 (`backend: fsdp`). Same micro-batching, losses and stats as
TorchEngine; what differs:

- Each rank holds 1/N of every parameter (a DTensor) and of AdamW's state; a transformer block's
  parameters are all-gathered for its forward and backward, its gradients reduce-scattered (summed:
  each micro-batch's loss is already scaled by its share of the global token count).
- Every forward gathers collectively, so every rank runs the same number of passes: a rank with
  fewer micro-batches adds idle ones (zero gradients).
- dtype=bfloat16 (the default "auto" on a GPU) gathers the parameters in bf16 and reduces gradients
  in fp32 (MixedPrecisionPolicy); the sharded fp32 parameters are the optimizer's master copy. On a
  GPU an inference-only role in bf16 shards bf16 parameters (TorchEngine's docstring says why).
- The mesh is the data-parallel group on this rank's device (its GPU under NCCL, set before the
  group was created; the CPU under gloo).
- save_hf / hf_state_dict gather the full weights to rank 0 (collective); save_state writes each
  rank's own shards, so a run resumes on the same data-parallel size.
- LoRA (role.lora): TorchEngine wraps the model with PEFT before `_parallelize`, so each block's
  FSDP unit holds its frozen base weights and its adapters; adapter_state / save_hf(merged=False)
  gather the adapters alone, a merged export gathers the base too; save_state keeps the adapters'
  shards only.
- No generation here (one rank decoding alone would hang the others' gathers): fsdp roles sample
  on generation servers.
- Value and score heads (role.head) are TorchEngine's: the one-output linear head is a parameter of
  the root unit, gathered with the embeddings; save_hf writes the same HF classes.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX as _AC_PREFIX
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from realcore.api.engine import GenerationResult
from realcore.backends import lora
from realcore.backends.fsdp import apply_ac, apply_fsdp
from realcore.backends.torch_engine import TorchEngine, rng_state, set_rng_state


class FSDPEngine(TorchEngine):
    """One data-parallel rank of a model role whose parameters are sharded over the group."""

    def _parallelize(self) -> None:
        if not self.distributed:
            raise ValueError("backend=fsdp needs torch.distributed initialised (the training mesh of a run)")
        if self.role.gradient_checkpointing:  # before sharding: the FSDP unit wraps the checkpointed block
            apply_ac(self.model)
        # The model is still on the CPU: fully_shard moves each unit to the mesh's device as it shards
        # it, so a GPU never holds more than the shards plus one whole unit.
        mesh = DeviceMesh.from_group(self.group, self.device.type)  # cuda: the current device, this rank's GPU
        apply_fsdp(self.model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32))
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum over ranks, as TorchEngine does
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)

    def _autocast(self):
        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts the gathered parameters instead

    def _idle_passes(self, n_passes: int) -> int:
        n = torch.tensor([n_passes], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        return int(n) - n_passes

    def _reduce_grads(self) -> None:
        pass  # FSDP reduce-scattered every micro-batch's gradients in its backward

    def generate(self, prompts: list[list[int]], gconfig) -> list[GenerationResult]:
        raise NotImplementedError("fsdp roles generate through generation servers (allocation_mode local.dN+...)")

    # ---- weights and state ----

    def _full_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full state dict (the wrapped model's names) on rank 0 (CPU, float32)."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.rank == 0 else None

    def _full_adapter(self) -> dict[str, torch.Tensor] | None:
        """Collective: the LoRA parameters alone, whole, on rank 0 (the wrapped model's names, AC's
        prefix removed as get_model_state_dict does): an adapter update gathers no base weight."""
        out = {n.replace(_AC_PREFIX, ""): p.detach().full_tensor().cpu()
               for n, p in self.model.named_parameters() if "lora_" in n}
        return out if self.rank == 0 else None

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full weights under HF names on rank 0 (CPU, float32), None elsewhere;
        with LoRA base + adapter merged (what the nccl update broadcasts)."""
        state = self._full_state()
        if state is not None and self.role.lora is not None:
            return lora.merge_state(state, self.role.lora)
        return state

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the adapter under PEFT's saved names on rank 0, None elsewhere."""
        state = self._full_adapter()
        return lora.gathered_adapter(state) if state is not None else None

    def save_hf(self, path: str, *, merged: bool = True) -> None:
        """Collective: every rank sends its shards, rank 0 writes the HF directory atomically. With
        LoRA the adapter folder, plus `merged/` as TorchEngine.save_hf (only then is the base gathered)."""
        export = self._exports_merged(merged)
        state = self._full_state() if self.role.lora is None or export else self._full_adapter()
        if state is None:  # not rank 0
            return
        if self.role.lora is None:
            self._write_hf(os.path.abspath(path), state)
        else:
            self._write_hf(os.path.abspath(path), adapter=lora.gathered_adapter(state),
                           merged=lora.merge_state(state, self.role.lora) if export else None)

    def save_state(self, path: str) -> None:
        """This rank's shards of the weights and optimizer state, with the schedule, version and RNG.
        With LoRA only the adapters' shards: the frozen base is the model directory's."""
        if self.optimizer is not None:
            model, optim = get_state_dict(self.model, self.optimizer)
        else:
            model, optim = get_model_state_dict(self.model), None
        if self.role.lora is not None:
            model = {n: t for n, t in model.items() if "lora_" in n}
        torch.save({
            "model": _local(model), "optimizer": _local(optim),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "version": self.version, **rng_state(self.device), "dp": [self.rank, self.world_size],
        }, os.path.join(path, "engine.pt"))

    def load_state(self, path: str) -> None:
        # On the host: the RNG states must be CPU tensors; _like moves each shard to its parameter's device.
        state = torch.load(os.path.join(path, "engine.pt"), map_location="cpu", weights_only=True)
        if state["dp"] != [self.rank, self.world_size]:
            raise ValueError(f"load_state: {path} holds the shards of data-parallel rank {state['dp'][0]} of "
                             f"{state['dp'][1]}, this is rank {self.rank} of {self.world_size} (resume on the same mesh)")
        # The live state dicts give every shard's layout (mesh, placement, global shape).
        if self.optimizer is not None:
            model, optim = get_state_dict(self.model, self.optimizer)  # creates AdamW's state if none yet
        else:
            model, optim = get_model_state_dict(self.model), None
        options = None
        if self.role.lora is not None:  # the adapters alone; the base stays the model directory's
            want, saved = {n for n in model if "lora_" in n}, set(state["model"])
            if saved != want:
                raise ValueError(f"lora: the recover state does not fit this model's adapters (unexpected "
                                 f"{sorted(saved - want)[:3]}, missing {sorted(want - saved)[:3]})")
            options = StateDictOptions(strict=False)
        if self.optimizer is not None:
            set_state_dict(self.model, self.optimizer, model_state_dict=_like(state["model"], model),
                           optim_state_dict=_like(state["optimizer"], optim), options=options)
            self.scheduler.load_state_dict(state["scheduler"])
        else:
            set_model_state_dict(self.model, _like(state["model"], model), options=options)
        self.version = state["version"]
        set_rng_state(state, self.device)


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
