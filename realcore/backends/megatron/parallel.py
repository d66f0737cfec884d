"""Megatron parallel state for a realcore mesh, and config checks for Megatron's known pitfalls.

`check_megatron_config` runs in the launcher before any process starts, so a bad combination is
one clear line instead of a silently wrong gradient (docs/megatron-cpu.md lists them).
"""

from __future__ import annotations

import torch

from realcore.api.alloc import ParallelDims
from realcore.api.config import MegatronConfig
from realcore.backends.megatron.convert import num_experts, validate


def sequence_parallel(mcfg: MegatronConfig, dims: ParallelDims) -> bool:
    return dims.tp > 1 if mcfg.sequence_parallel is None else mcfg.sequence_parallel


def check_megatron_config(role: str, mcfg: MegatronConfig, dims: ParallelDims, hf_config, *,
                          cuda: bool | None = None) -> None:
    """Raise ValueError (one line, naming the setting) for layouts Megatron gets wrong or refuses."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    where = f"{role}.megatron"
    if dims.cp > 1 and not cuda:
        raise ValueError(f"allocation_mode: context parallel (c{dims.cp}) needs TransformerEngine attention on "
                         "GPUs; this machine has no CUDA: use c1")
    if dims.cp > 1:
        try:
            import transformer_engine  # noqa: F401  (optional: only asked whether it is installed)
        except ImportError:
            raise ValueError(f"allocation_mode: context parallel (c{dims.cp}) needs TransformerEngine; "
                             "it is not installed") from None
    vpp = mcfg.virtual_pipeline_stages
    if vpp is not None:
        if dims.pp == 1:
            raise ValueError(f"{where}.virtual_pipeline_stages: needs pipeline parallel (pN with N > 1)")
        if dims.pp == 2 and mcfg.batch_p2p_comm:
            raise ValueError(f"{where}.batch_p2p_comm: with virtual pipeline stages at PP=2 batched p2p gives "
                             "wrong gradients (Megatron-LM #750); set batch_p2p_comm=false overlap_p2p_comm=true")
    elif mcfg.overlap_p2p_comm:
        raise ValueError(f"{where}.overlap_p2p_comm: only with virtual_pipeline_stages")
    sp = sequence_parallel(mcfg, dims)
    if sp and dims.tp == 1:
        raise ValueError(f"{where}.sequence_parallel: needs tensor parallel (tN with N > 1)")
    experts = num_experts(hf_config)
    if experts is None and dims.ep > 1:
        raise ValueError(f"allocation_mode: expert parallel (e{dims.ep}) needs an MoE model; "
                         f"{hf_config.model_type} has no experts")
    if experts is not None:
        if dims.tp > 1 and not sp:
            raise ValueError(f"{where}.sequence_parallel: MoE with tensor parallel needs sequence parallel")
        if experts % dims.ep:
            raise ValueError(f"allocation_mode: {experts} experts are not divisible by e{dims.ep}")
        if (dims.dp * dims.cp * dims.tp) % dims.ep:
            raise ValueError(f"allocation_mode: expert parallel e{dims.ep} must divide d{dims.dp} x c{dims.cp} x "
                             f"t{dims.tp} (experts are split over the data and tensor parallel ranks)")
    n_stages = dims.pp * (vpp or 1)
    try:
        validate(hf_config, tp=dims.tp, pp=n_stages)
    except ValueError as e:
        what = f"pp={dims.pp} x virtual_pipeline_stages={vpp}" if vpp else f"pp={dims.pp}"
        raise ValueError(f"allocation_mode: {e}".replace(f"pp={n_stages}", what)) from None


def init_parallel_state(dims: ParallelDims, mcfg: MegatronConfig, seed: int) -> None:
    """Megatron's process groups over the already-initialised default group (idempotent for the
    same sizes: every role of a run shares one mesh)."""
    from megatron.core import parallel_state, tensor_parallel  # the launcher imports this module without megatron

    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_virtual_pipeline_model_parallel_world_size())
        if have != (dims.tp, dims.pp, mcfg.virtual_pipeline_stages):
            raise ValueError(f"megatron: roles need the same mesh, got tp/pp/vpp {have} and "
                             f"{(dims.tp, dims.pp, mcfg.virtual_pipeline_stages)}")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=mcfg.virtual_pipeline_stages,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=1,  # matches convert.mcore_config_from_hf
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
