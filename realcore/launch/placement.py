"""scheduler=local: which GPUs each process of a run gets (its CUDA_VISIBLE_DEVICES).

The node's GPU slots are `system.gpus`, else the GPUs this launcher sees (its own
CUDA_VISIBLE_DEVICES entries, else torch's NVML count, which creates no CUDA context). A GPU named
twice in system.gpus is two slots: two processes share it.

The plan places as AReaL does. With generation servers (`sglang.d4p1t1+d4p1t1`, async or sync):
the servers first, server i on the next tp*pp slots (a built-in server is one process on one slot;
none with generation.device=cpu), then one slot per training rank. Colocated (`d8p1t1`, no
servers: the synchronous generate MFC runs inside its rank): model_worker/r on slot r. A process
that computes on no GPU (master, gserver manager, rollout workers) gets CUDA_VISIBLE_DEVICES="",
so it never opens a CUDA context on a GPU another process owns. Each process then uses `cuda:0`,
the first GPU it sees (realcore/backends/device.py).

A node with no GPU gets the empty plan: no process's environment changes (a CPU run stays as it
was). A node with too few slots is a ConfigError naming both numbers, before anything starts.

Test switch (not a user option): REALCORE_TEST_NODE_GPUS=N makes the launcher believe the node has
GPUs 0..N-1, so that placement runs on a CPU machine; there the processes see no CUDA device under
those ids and run on the CPU.
"""

from __future__ import annotations

import os
import shlex
from collections import Counter
from dataclasses import dataclass, field

from realcore.api.alloc import AllocationMode
from realcore.api.config import ExperimentConfig
from realcore.backends.clients.registry import capabilities
from realcore.backends.server_launch import SERVER_MEM_FRACTION
from realcore.launch.config_loader import ConfigError

TEST_SWITCH = "REALCORE_TEST_NODE_GPUS"


@dataclass(frozen=True)
class Plan:
    slots: tuple[str, ...]  # the node's GPU slots, in placement order
    source: str  # where the slots came from, for the printed plan
    gpus: dict[str, tuple[str, ...]] = field(default_factory=dict)  # process name -> its GPUs (those with some)
    hide: bool = False  # processes without GPUs get CUDA_VISIBLE_DEVICES="" (a GPU node)

    def env(self, name: str) -> dict[str, str]:
        """What process `name`'s environment gets on top of the launcher's: {} in the empty plan."""
        if name in self.gpus:
            return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus[name])}
        return {"CUDA_VISIBLE_DEVICES": ""} if self.hide else {}

    def sharing(self, name: str) -> int:
        """How many processes the most crowded of `name`'s GPUs holds (1: its GPUs are its own)."""
        held = Counter(g for gpus in self.gpus.values() for g in set(gpus))
        return max((held[g] for g in self.gpus.get(name, ())), default=1)

    def mem_fraction(self, name: str, configured: float | None) -> float:
        """An SGLang/vLLM server's share of each of its GPUs: rollout.server_mem_fraction if set, else
        SERVER_MEM_FRACTION divided among the processes placed on its GPUs."""
        if configured is not None:
            return configured
        return round(SERVER_MEM_FRACTION / self.sharing(name), 4)


def node_gpus(cfg: ExperimentConfig) -> tuple[list[str], str]:
    """(the node's GPU slots, where they came from)."""
    if cfg.system.gpus is not None:
        for g in cfg.system.gpus:
            if not g.strip() or "," in g:
                raise ConfigError(f"system.gpus: {g!r} is not a GPU (an index or UUID, as CUDA_VISIBLE_DEVICES names it)")
        return [g.strip() for g in cfg.system.gpus], "system.gpus"
    switch = os.environ.get(TEST_SWITCH)
    if switch is not None:
        if not switch.isdigit():
            raise ConfigError(f"{TEST_SWITCH}={switch!r}: a number of GPUs (a test switch)")
        return [str(i) for i in range(int(switch))], f"{TEST_SWITCH}={switch}, a test switch"
    import torch  # the launcher imports torch only when it must count GPUs

    count = torch.cuda.device_count()  # NVML: honours CUDA_VISIBLE_DEVICES, creates no context
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and count:
        # CUDA stops at an entry it cannot use: the first `count` entries are the GPUs seen.
        return [g.strip() for g in visible.split(",") if g.strip()][:count], "CUDA_VISIBLE_DEVICES"
    return [str(i) for i in range(count)], "the visible CUDA devices"


def gpus_per_server(cfg: ExperimentConfig, alloc: AllocationMode) -> int:
    """GPUs one generation server holds: tp*pp for SGLang/vLLM (its own TP/PP workers), 1 for a
    built-in server, 0 for a built-in server told to run on the CPU."""
    if alloc.gen is None:
        return 0
    if not capabilities(alloc.backend).own_worker:
        return alloc.gen.tp * alloc.gen.pp
    return 0 if cfg.generation.device == "cpu" else 1


def process_names(cfg: ExperimentConfig, alloc: AllocationMode) -> list[str]:
    """Every process a local run starts, in plan order: servers, training ranks, the rest."""
    names = [f"gen_server/{i}" for i in range(alloc.gen.dp if alloc.gen is not None else 0)]
    names += [f"model_worker/{r}" for r in range(alloc.world_size)]
    if cfg.mode == "async":
        names += ["gserver_manager"] + [f"rollout_worker/{i}" for i in range(cfg.rollout.n_workers)]
    return names + ["master"]


def make_plan(cfg: ExperimentConfig, alloc: AllocationMode, slots: list[str], source: str) -> Plan:
    """The placement of `alloc` on `slots` (module docstring); ConfigError when they are too few."""
    if not slots:
        # system.gpus=[] asks for the CPU on a node that may have GPUs: hide them from every process.
        return Plan((), source, hide=source == "system.gpus")
    per_server = gpus_per_server(cfg, alloc)
    n_servers = alloc.gen.dp if alloc.gen is not None else 0
    need = n_servers * per_server + alloc.world_size
    if need > len(slots):
        parts = f"{n_servers} generation server(s) x {per_server} + " if n_servers * per_server else ""
        raise ConfigError(f"allocation_mode: {cfg.allocation_mode} needs {need} GPUs ({parts}{alloc.world_size} "
                          f"training rank(s)) and this node has {len(slots)} ({source}); use a smaller allocation_mode "
                          "or name more slots in system.gpus")
    gpus: dict[str, tuple[str, ...]] = {}
    nxt = 0
    for i in range(n_servers if per_server else 0):
        gpus[f"gen_server/{i}"] = tuple(slots[nxt:nxt + per_server])
        nxt += per_server
    for r in range(alloc.world_size):
        gpus[f"model_worker/{r}"] = (slots[nxt],)
        nxt += 1
    for name, held in gpus.items():
        if len(set(held)) < len(held):
            raise ConfigError(f"system.gpus: {name} would get GPU {held[0]} twice ({list(held)}): a server's tp*pp "
                              "ranks need distinct GPUs; order system.gpus so that its slots differ")
    return Plan(tuple(slots), source, gpus, hide=True)


def plan_local(cfg: ExperimentConfig, alloc: AllocationMode) -> Plan:
    """The plan of a local run on this node."""
    slots, source = node_gpus(cfg)
    return make_plan(cfg, alloc, slots, source)


def describe(cfg: ExperimentConfig, alloc: AllocationMode, plan: Plan, commands: dict[str, list[str]]) -> str:
    """The plan as printed by `--dry-run` and at the start of a run on GPUs: one line per process
    with its CUDA_VISIBLE_DEVICES, then the command line of each SGLang/vLLM server (`commands`)."""
    names = process_names(cfg, alloc)
    width = max(len(n) for n in names)
    if plan.slots:
        head = f"realcore: placement of {cfg.allocation_mode} on {len(plan.slots)} GPU slot(s) [{','.join(plan.slots)}] ({plan.source}):"
    elif plan.hide:
        head = "realcore: placement: every process on the CPU (system.gpus=[]: CUDA_VISIBLE_DEVICES=\"\" for all):"
    else:
        head = f"realcore: placement: no GPU on this node ({plan.source}): every process on the CPU, its environment unchanged:"
    lines = [head]
    for name in names:
        if name in plan.gpus:
            where = f"CUDA_VISIBLE_DEVICES={','.join(plan.gpus[name])}"
            if plan.sharing(name) > 1:
                where += f"  (a GPU shared by {plan.sharing(name)} processes)"
        elif plan.hide:
            where = 'CUDA_VISIBLE_DEVICES=""  (no GPU)'
        else:
            where = "CPU"
        lines.append(f"  {name:<{width}}  {where}")
        if name in commands:
            lines.append(f"  {'':<{width}}    $ {shlex.join(commands[name])}")
    return "\n".join(lines)


def check_nccl(cfg: ExperimentConfig, alloc: AllocationMode, *, trainer_on_gpu: bool, servers_on_gpu: bool,
               shared: str | None = None) -> None:
    """rollout.weight_update=nccl joins trainer rank 0 and every server in one group: NCCL when the
    trainer is on a GPU, gloo when it is on the CPU (every CPU run). NCCL refuses two ranks of a
    group on one GPU (`shared`: the server placed with rank 0) and cannot reach a rank on the CPU."""
    if alloc.gen is None or cfg.rollout.weight_update != "nccl":
        return
    own_worker = capabilities(alloc.backend).own_worker
    instead = "rollout.weight_update=memory or disk" if own_worker else "rollout.weight_update=disk"
    if shared is not None:
        raise ConfigError(f"rollout.weight_update=nccl: trainer rank 0 and {shared} share a GPU (system.gpus), and "
                          f"NCCL refuses two ranks of one group on one GPU; use {instead}, or GPUs of their own")
    if trainer_on_gpu != servers_on_gpu:
        where = {True: "on a GPU", False: "on the CPU"}
        why = " (generation.device=cpu)" if own_worker and cfg.generation.device == "cpu" else ""
        raise ConfigError(f"rollout.weight_update=nccl: NCCL needs both on GPUs, and the trainer is "
                          f"{where[trainer_on_gpu]} while the generation servers are {where[servers_on_gpu]}{why}; "
                          f"use {instead}")


def describe_meshes(cfg: ExperimentConfig, alloc: AllocationMode) -> str:
    """One line per training mesh: its roles and its model workers (printed when roles have meshes of their own)."""
    lines = ["realcore: training meshes (docs/roles.md):"]
    for m in alloc.meshes(cfg.roles()):
        d = m.dims
        workers = f"model_worker/{m.first}" + (f"-{m.workers[-1]}" if d.world_size > 1 else "")
        lines.append(f"  {', '.join(m.roles)}: {workers} (d{d.dp}p{d.pp}t{d.tp}c{d.cp}e{d.ep})")
    return "\n".join(lines)
