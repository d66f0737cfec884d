"""Everything that can be checked before a process starts: one ConfigError line per problem."""

from __future__ import annotations

import importlib.util

from realcore.api.alloc import AllocationMode, parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.api.registry import lookup
from realcore.dfg.graph import DataFlowGraph, build_graph
from realcore.launch.config_loader import ConfigError, import_user_modules
from realcore.system.batch_source import source_keys


def validate(cfg: ExperimentConfig) -> tuple[DataFlowGraph, AllocationMode]:
    """Everything that can be checked before a process starts."""
    import_user_modules(cfg)
    try:
        alloc = parse_allocation_mode(cfg.allocation_mode)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.mode == "async" and alloc.gen is None:
        raise ConfigError(f"allocation_mode: mode=async needs generation servers, e.g. local.d2p1t1+{cfg.allocation_mode}")
    if alloc.gen is not None:
        check_generation_servers(cfg, alloc)
    if cfg.mode == "async":
        try:
            lookup("agent", cfg.rollout.agent)
        except KeyError as e:
            raise ConfigError(f"rollout.agent: {e.args[0]}") from None
    mesh = alloc.train
    for role, r in cfg.roles().items():
        if r.backend == "torch" and (mesh.pp, mesh.tp, mesh.cp, mesh.ep) != (1, 1, 1, 1):
            raise ConfigError(f"allocation_mode: {role}.backend=torch supports data parallel only (got {cfg.allocation_mode}); use pN/tN with the megatron backend")
        if r.backend == "megatron" and importlib.util.find_spec("megatron") is None:
            raise ConfigError(f"{role}.backend=megatron needs megatron-core: pip install -e '.[megatron]'")
    for m in cfg.mfcs:
        generates = getattr(_mfc_class(m.type), "generates", False)
        if generates and alloc.gen is None and m.model is not None and cfg.roles()[m.model].backend == "megatron":
            raise ConfigError(f"mfcs ({m.name}): {m.model}.backend=megatron samples on generation servers; "
                              f"use allocation_mode=local.d1+{cfg.allocation_mode}")
    try:
        keys = source_keys(cfg)
    except KeyError as e:
        raise ConfigError(f"dataset.type: {e.args[0]}") from None
    dfg = build_graph(cfg, keys)
    for node in dfg.nodes.values():
        if node.n_seqs < mesh.dp:
            raise ConfigError(f"mfcs ({node.name}).n_seqs: {node.n_seqs} samples < data-parallel size {mesh.dp}")
        if cfg.trainer.batch_size % node.n_seqs:
            raise ConfigError(f"mfcs ({node.name}).n_seqs: {node.n_seqs} does not divide trainer.batch_size {cfg.trainer.batch_size}")
    return dfg, alloc


def _mfc_class(type_name: str):
    try:
        return lookup("mfc", type_name)
    except KeyError:
        return None  # build_graph reports unknown types with the node's name


def check_generation_servers(cfg: ExperimentConfig, alloc: AllocationMode) -> None:
    """Generation servers of `local.*|sglang.*|vllm.*` allocation modes (sync or async)."""
    if alloc.backend not in ("local", "sglang", "vllm"):
        raise ConfigError(f"allocation_mode: unknown generation engine {alloc.backend!r} (local, sglang, vllm)")
    if alloc.backend == "local" and alloc.gen.world_size != alloc.gen.dp:
        raise ConfigError(f"allocation_mode: built-in servers are data parallel only (local.dN), got {cfg.allocation_mode!r}")
    from realcore.backends.server_launch import engine_available

    missing = engine_available(alloc.backend)
    if missing:
        raise ConfigError(f"allocation_mode: {missing}")
    if alloc.backend != "local" and cfg.rollout.weight_update == "memory":
        raise ConfigError("rollout.weight_update: memory works with built-in servers only (allocation_mode local.*)")


def check_model_layout(cfg: ExperimentConfig, alloc: AllocationMode) -> None:
    """Checks that need the model's config: Megatron's parallel layout and its known pitfalls."""
    roles = {role: r for role, r in cfg.roles().items() if r.backend == "megatron"}
    if not roles:
        return
    from transformers import AutoConfig

    from realcore.backends.megatron.parallel import check_megatron_config

    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    for role, r in roles.items():
        try:
            check_megatron_config(role, r.megatron, alloc.train, hf_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_slurm(cfg: ExperimentConfig, alloc: AllocationMode, dry_run: bool) -> None:
    import shutil

    from realcore.launch.slurm import steps

    try:
        steps(cfg, alloc)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not dry_run:
        missing = [b for b in ("sbatch", "squeue", "scontrol", "scancel") if shutil.which(b) is None]
        if missing:
            raise ConfigError(f"scheduler=slurm: {', '.join(missing)} not found (is this a Slurm login node?)")


def check_ray(cfg: ExperimentConfig, alloc: AllocationMode) -> None:
    from realcore.launch.ray_scheduler import worker_specs

    if importlib.util.find_spec("ray") is None:
        raise ConfigError("scheduler=ray needs Ray: pip install -e '.[ray]'")
    try:
        worker_specs(cfg, alloc)
    except ValueError as e:
        raise ConfigError(str(e)) from None
