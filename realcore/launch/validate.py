"""Everything that can be checked before a process starts: one ConfigError line per problem."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from collections import Counter

import realcore.workflows  # noqa: F401  (the built-in workflows register on import)

from realcore.api.alloc import AllocationMode, parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.api.registry import MFCSpec, lookup, make_workflow, mfc_spec
from realcore.backends.clients import registry as clients
from realcore.data.datasets import SKIP_TOO_LONG, LoadedDataset, describe_skips
from realcore.dfg.graph import DataFlowGraph, build_graph
from realcore.dfg.prune import drop_unread_mfcs
from realcore.launch.chat_template import resolve_chat_template
from realcore.launch.config_loader import ConfigError, import_user_modules
from realcore.launch.placement import Plan, check_nccl, node_gpus, plan_local
from realcore.launch.ray_scheduler import check_ray_gpus, worker_specs
from realcore.launch.slurm import resolve_gpus_per_node, steps
from realcore.api.registry import source_keys

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,127}")


def validate(cfg: ExperimentConfig) -> tuple[DataFlowGraph, AllocationMode]:
    """What the config alone tells (after loading `imports`); check_inputs reads the model and dataset."""
    check_names(cfg)
    if cfg.script is not None and not os.path.isfile(cfg.script):
        raise ConfigError(f"script: {cfg.script} is not a file")
    if cfg.script is not None:  # the master may start in another folder (a Slurm step, a Ray task)
        cfg.script = os.path.abspath(cfg.script)
    if cfg.logging.wandb.project is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb.project is set but the wandb package is not installed: pip install wandb")
    import_user_modules(cfg)
    check_registered(cfg)
    for line in drop_unread_mfcs(cfg):  # before anything reads cfg.roles(): a dropped role is never built
        print(f"realcore: {line}", flush=True)
    try:
        alloc = parse_allocation_mode(cfg.allocation_mode)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.mode == "sync" and cfg.rollout.filter_equal_reward_groups:
        raise ConfigError("rollout.filter_equal_reward_groups: async mode only (a sync batch cannot drop a group)")
    if cfg.mode == "async" and alloc.gen is None:
        raise ConfigError(f"allocation_mode: mode=async needs generation servers, e.g. local.d2p1t1+{cfg.allocation_mode}")
    if alloc.gen is not None:
        check_generation_servers(cfg, alloc)
    for role, r in cfg.roles().items():
        mesh = alloc.mesh_dims(role)
        if r.backend in ("torch", "fsdp") and (mesh.pp, mesh.tp, mesh.cp, mesh.ep) != (1, 1, 1, 1):
            raise ConfigError(f"allocation_mode: {role}.backend={r.backend} supports data parallel only (got {cfg.allocation_mode}); use pN/tN with the megatron backend")
        if r.backend == "megatron" and importlib.util.find_spec("megatron") is None:
            raise ConfigError(f"{role}.backend=megatron needs megatron-core: pip install -e '.[megatron]'")
        check_dtype(cfg, role, r.backend, r.dtype)
        if r.lora is not None and r.head != "policy":
            raise ConfigError(f"{role}.lora: a {r.head} head trains every weight (LoRA is for policy heads); drop lora")
    for m in cfg.mfcs:
        generates = _spec(m.type).generates
        backend = cfg.roles()[m.model].backend if m.model is not None else None
        if generates and alloc.gen is None and backend in ("megatron", "fsdp"):
            raise ConfigError(f"mfcs ({m.name}): {m.model}.backend={backend} samples on generation servers; "
                              f"use allocation_mode=local.d1+{cfg.allocation_mode}")
    if cfg.eval.freq_steps is not None and alloc.gen is None and cfg.actor.backend == "fsdp":
        raise ConfigError(f"eval.freq_steps: actor.backend=fsdp evaluates on generation servers; use "
                          f"allocation_mode=local.d1+{cfg.allocation_mode} or eval.freq_steps=null")
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


def check_dtype(cfg: ExperimentConfig, role: str, backend: str, dtype: str) -> None:
    """bfloat16 needs hardware that has it. Checked here for a local run on the CPU; a process placed
    on a GPU (and every process on a cluster node) checks its own device when it starts: asking
    here would open a CUDA context in the launcher, on a GPU another process is placed on."""
    if dtype != "bfloat16":
        return
    if cfg.scheduler == "local" and not node_gpus(cfg)[0]:
        from realcore.backends.precision import bf16_unsupported  # torch: only a bfloat16 run on the CPU asks

        why = bf16_unsupported("cpu")
        if why is not None:
            raise ConfigError(f"{role}.{why}")


def check_placement(cfg: ExperimentConfig, alloc: AllocationMode) -> Plan:
    """scheduler=local: the plan of this node's GPUs (placement.py), and what it rules out."""
    plan = plan_local(cfg, alloc)
    servers = [f"gen_server/{i}" for i in range(alloc.gen.dp)] if alloc.gen is not None else []
    if servers and clients.capabilities(alloc.backend).own_worker and cfg.generation.device == "cuda" and not plan.gpus:
        raise ConfigError(f"generation.device=cuda: this node has no GPU for the built-in servers ({plan.source}); "
                          "use generation.device=auto or cpu")
    shared = None
    trainer = set(plan.gpus.get("model_worker/0", ()))
    for name in servers:
        common = sorted(trainer & set(plan.gpus.get(name, ())))
        if common:
            shared = f"{name} on GPU {common[0]}"
            break
    check_nccl(cfg, alloc, trainer_on_gpu=bool(trainer), servers_on_gpu=any(n in plan.gpus for n in servers),
               shared=shared)
    return plan


def check_names(cfg: ExperimentConfig) -> None:
    """experiment_name and trial_name name folders and name-resolution keys: no '/', no '..'."""
    for key in ("experiment_name", "trial_name"):
        value = getattr(cfg, key)
        if not NAME.fullmatch(value) or ".." in value:
            raise ConfigError(f"{key}: {value!r} is not a valid name (up to 128 letters, digits and _ . + = -, "
                              "starting with a letter, digit or _, no '..')")


def check_registered(cfg: ExperimentConfig) -> None:
    """Names the workers look up in the registries (MFC types: build_graph, with the node's name)."""
    named = [("reward.type", "reward", cfg.reward.type), ("dataset.type", "dataset", cfg.dataset.type),
             ("rollout.workflow", "workflow", cfg.rollout.workflow)]
    if cfg.eval.dataset is not None:
        named.append(("eval.dataset.type", "dataset", cfg.eval.dataset.type))
    for key, kind, name in named:
        try:
            lookup(kind, name)
        except KeyError as e:
            raise ConfigError(f"{key}: {e.args[0]}") from None
    try:  # a workflow's constructor checks its arguments
        make_workflow(cfg.rollout.workflow, cfg.rollout.workflow_kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"rollout.workflow_kwargs: workflow {cfg.rollout.workflow!r}: {e}") from None


def check_inputs(cfg: ExperimentConfig, alloc: AllocationMode) -> LoadedDataset:
    """What the model directory and the dataset tell, read here before any worker starts: the model's
    files are whole, every dataset shard has a usable row, prompts plus max_new_tokens fit the
    model's context. Returns the dataset as one shard (rows, usable, skip counts)."""
    from realcore.backends.models import check_model_dir, context_length, load_tokenizer  # torch and transformers

    try:
        hf_config = check_model_dir(cfg.model.path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for role, r in cfg.roles().items():
        if r.model_path is not None:
            try:
                check_model_dir(r.model_path)
            except ValueError as e:
                raise ConfigError(f"{role}.model_path: {e}") from None
    try:
        tokenizer = load_tokenizer(cfg.model.path)
    except Exception as e:  # transformers raises many types for a tokenizer it cannot load
        why = " ".join(str(e).split())
        raise ConfigError(f"model.path: cannot load the tokenizer of {cfg.model.path}: {why}") from None
    print(f"realcore: {resolve_chat_template(cfg, tokenizer)}", flush=True)  # before the dataset's prompts are made
    loaded = quietly(check_dataset, cfg, alloc, tokenizer)
    if any(_spec(m.type).generates for m in cfg.mfcs) or cfg.mode == "async":
        check_context(cfg, context_length(hf_config), loaded)
    return loaded


def quietly(fn, *args):
    """`fn(*args)` with transformers' warnings off: tokenizing a row longer than the model's context
    warns "Token indices sequence length is longer than ..." before realcore's own one line (the
    row is skipped, or the run refused, with a message naming dataset.max_prompt_len)."""
    from transformers.utils import logging as hf_logging  # heavy: only the launcher's input checks load it

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return fn(*args)
    finally:
        hf_logging.set_verbosity(level)


def check_dataset(cfg: ExperimentConfig, alloc: AllocationMode, tokenizer) -> LoadedDataset:
    """Load every shard as the workers will (one per rollout worker in async mode, one per data-parallel
    replica in sync mode): each needs a usable row, else the message gives the skip counts."""
    ds = cfg.dataset
    if cfg.mode == "async":
        world, holders = cfg.rollout.n_workers, "rollout.n_workers"
    else:
        world, holders = alloc.train.dp, "data-parallel size"
    load = lookup("dataset", ds.type)
    shards = []
    for rank in range(world):
        try:
            shards.append(load(ds, tokenizer, rank=rank, world=world, use_chat_template=cfg.model.use_chat_template))
        except ValueError as e:
            why = " ".join(str(e).split())
            raise ConfigError(why if why.startswith("dataset") else f"dataset.type={ds.type}: {why}") from None
        except Exception as e:  # a user's dataset: one line; its workers would fail the same way
            why = " ".join(str(e).split())
            raise ConfigError(f"dataset.type={ds.type}: loading failed: {type(e).__name__}: {why}") from None
    skipped = sum((Counter(s.skipped) for s in shards), Counter())
    whole = LoadedDataset([x for s in shards for x in s.samples], sum(s.n_rows for s in shards),
                          sum(skipped.values()), dict(skipped))
    where = f"dataset.path: {ds.path}" if ds.type in ("jsonl", "parquet", "hf") else f"dataset.type={ds.type}"
    hint = "; raise dataset.max_prompt_len?" if SKIP_TOO_LONG in skipped else ""
    if not whole.samples:
        raise ConfigError(f"{where}: no usable row ({_rows(whole.n_rows)}; skipped {describe_skips(skipped)}){hint}")
    for rank, s in enumerate(shards):
        if not s.samples:
            raise ConfigError(f"{where}: shard {rank} of {world} ({holders} {world}) has no usable row ({_rows(s.n_rows)}; "
                              f"skipped {describe_skips(s.skipped)}): fewer shards or more rows{hint}")
    return whole


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def check_context(cfg: ExperimentConfig, context: int | None, loaded: LoadedDataset) -> None:
    """Generation needs room: the engines refuse a prompt whose length plus max_new_tokens exceeds
    the model's positions, which would otherwise fail every request of the run."""
    if context is None:
        return
    new = cfg.generation.max_new_tokens
    if new >= context:
        raise ConfigError(f"generation.max_new_tokens: {new} leaves no room for a prompt in the model's context of "
                          f"{context} tokens (max_position_embeddings of {cfg.model.path})")
    longest = max((int(t.numel()) for s in loaded.samples for t in s.get("prompt_ids", ())), default=0)
    if longest + new > context:
        raise ConfigError(f"generation.max_new_tokens: {new} + the longest prompt ({longest} tokens) exceeds the model's "
                          f"context of {context} tokens; lower it or dataset.max_prompt_len")


def _spec(type_name: str) -> MFCSpec:
    try:
        return mfc_spec(type_name)
    except (KeyError, TypeError):
        return MFCSpec()  # build_graph reports unknown types and bad specs with the node's name


def check_generation_servers(cfg: ExperimentConfig, alloc: AllocationMode) -> None:
    """Generation servers of `ENGINE.*` allocation modes (sync or async): what the engine's
    capabilities allow (realcore.api.generation; `local`, `sglang`, `vllm` and engines registered
    from `imports:`)."""
    try:
        caps = clients.capabilities(alloc.backend)
    except ValueError as e:
        raise ConfigError(f"allocation_mode: {e}") from None
    if caps.own_worker and alloc.gen.world_size != alloc.gen.dp:
        raise ConfigError(f"allocation_mode: built-in servers are data parallel only ({alloc.backend}.dN), got "
                          f"{cfg.allocation_mode!r}")
    if not caps.own_worker and (alloc.gen.cp, alloc.gen.ep) != (1, 1):
        raise ConfigError(f"allocation_mode: {alloc.backend} servers take dN, pN and tN only (got {cfg.allocation_mode!r})")
    # On a cluster the server starts on its node, which checks its own interpreter (engine_server.py).
    missing = clients.engine_available(alloc.backend, cfg.rollout.server_python) if cfg.scheduler == "local" else None
    if missing:
        raise ConfigError(f"allocation_mode: {missing}")

    def those(has) -> str:  # the engines that can, for the message
        return ", ".join(f"{n}.*" for n in clients.engines_with(has))

    update = cfg.rollout.weight_update
    if update == "memory" and update not in caps.weight_updates:
        raise ConfigError(f"rollout.weight_update: memory works with built-in servers only (allocation_mode "
                          f"{those(lambda c: 'memory' in c.weight_updates)})")
    if cfg.rollout.inflight_weight_update and not caps.inflight_weight_update:
        raise ConfigError(f"rollout.inflight_weight_update: needs built-in servers ({those(lambda c: c.inflight_weight_update)})")
    if cfg.actor.lora is not None and not caps.lora:
        raise ConfigError(f"actor.lora: LoRA runs serve the adapter on servers that load one ({alloc.backend}'s adapter "
                          f"loading is not wired); use {' or '.join(clients.engines_with(lambda c: c.lora))}")
    if update == "nccl" and update not in caps.weight_updates:
        raise ConfigError(f"rollout.weight_update: nccl works with {those(lambda c: 'nccl' in c.weight_updates)} "
                          f"servers ({alloc.backend}'s weight transfer has its own rendezvous, docs/weight-update.md); "
                          f"use disk with {alloc.backend}.*")


def check_model_layout(cfg: ExperimentConfig, alloc: AllocationMode) -> None:
    """Checks that need the model's config: the servers' TP, Megatron's parallel layout and its known pitfalls."""
    roles = {role: r for role, r in cfg.roles().items() if r.backend == "megatron"}
    servers_split = alloc.gen is not None and not clients.capabilities(alloc.backend).own_worker and alloc.gen.tp > 1
    if not roles and not servers_split:
        return
    from transformers import AutoConfig  # heavy, and megatron optional: only runs that split a model load them

    from realcore.backends.megatron.parallel import check_megatron_config

    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    heads = getattr(hf_config, "num_attention_heads", None)
    if servers_split and heads and heads % alloc.gen.tp:
        raise ConfigError(f"allocation_mode: {alloc.backend} servers of tp {alloc.gen.tp} split attention heads over "
                          f"ranks, and {cfg.model.path} has {heads}; use a tp that divides {heads}")
    for role, r in roles.items():
        try:
            check_megatron_config(role, r.megatron, alloc.mesh_dims(role), hf_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_slurm(cfg: ExperimentConfig, alloc: AllocationMode, dry_run: bool) -> None:
    """The job's steps can be built; slurm.gpus_per_node=None becomes what sinfo says."""
    resolve_gpus_per_node(cfg)
    try:
        gpus = {st.kind: st.gpus_per_task for st in steps(cfg, alloc)}
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_nccl(cfg, alloc, trainer_on_gpu=gpus["model_worker"] > 0, servers_on_gpu=gpus.get("gen_server", 0) > 0)
    if not dry_run:
        missing = [b for b in ("sbatch", "squeue", "scontrol", "scancel") if shutil.which(b) is None]
        if missing:
            raise ConfigError(f"scheduler=slurm: {', '.join(missing)} not found (is this a Slurm login node?)")


def check_ray(cfg: ExperimentConfig, alloc: AllocationMode) -> None:
    """ray.gpus_per_worker=None is decided at ray.init (the cluster's GPUs): run_ray checks nccl then."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("scheduler=ray needs Ray: pip install -e '.[ray]'")
    try:
        worker_specs(cfg, alloc)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.ray.gpus_per_worker is not None:
        check_ray_gpus(cfg, alloc, cfg.ray.gpus_per_worker)
