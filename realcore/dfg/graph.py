"""DataFlowGraph on networkx: MFC nodes connected by the buffer keys they produce and consume.

Built from the experiment config alone (YAML + registries). Keys nobody produces must be declared
by the data source (dataset or rollout stream): a typo is an error, never a silent dataset key.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
from pydantic import ValidationError

from realcore.api.config import ExperimentConfig, MFCConfig
from realcore.api.registry import lookup, mfc_spec, registered


class GraphError(ValueError):
    """An invalid graph; the message names the node and the key."""


@dataclass(frozen=True)
class MFCNode:
    name: str
    type: str
    model: str | None
    inputs: tuple[str, ...]  # buffer keys read
    outputs: tuple[str, ...]  # buffer keys written (after output_remap)
    input_remap: dict  # buffer key -> name the MFC reads
    output_remap: dict  # name the MFC writes -> buffer key
    n_seqs: int
    trains: bool

    def mfc_outputs(self) -> tuple[str, ...]:
        """Names the implementation writes (before remap)."""
        back = {v: k for k, v in self.output_remap.items()}
        return tuple(back.get(k, k) for k in self.outputs)


@dataclass
class DataFlowGraph:
    nodes: dict[str, MFCNode]
    graph: nx.DiGraph  # node names; edge attribute `keys`
    source_keys: tuple[str, ...]  # keys the data source provides

    def order(self) -> list[str]:
        """A topological order (stable: ties broken by declaration order)."""
        pos = {n: i for i, n in enumerate(self.nodes)}
        return list(nx.lexicographical_topological_sort(self.graph, key=pos.__getitem__))

    def levels(self) -> list[list[str]]:
        return [sorted(g) for g in nx.topological_generations(self.graph)]

    def sinks(self) -> list[str]:
        return [n for n in self.nodes if self.graph.out_degree(n) == 0]

    def describe(self) -> str:
        """The graph as text, one MFC per line in execution order."""
        lines = [f"source: {', '.join(self.source_keys)}"]
        for name in self.order():
            n = self.nodes[name]
            lines.append(f"{name} [{n.type} on {n.model or '-'}]: {', '.join(n.inputs)} -> {', '.join(n.outputs) or '(stats)'}")
        return "\n".join(lines)


def _check_args(where: str, m: MFCConfig, cls) -> None:
    """`args:` of an MFC entry against the pydantic model its class declares as `Args`."""
    model = getattr(cls, "Args", None)
    if model is None:
        if m.args:
            raise GraphError(f"{where}.args: MFC type {m.type!r} declares no Args model, so it takes no args")
        return
    try:
        model.model_validate(m.args)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise GraphError(f"{where}.args{'.' + loc if loc else ''}: {err['msg']}") from None


def _node(i: int, m: MFCConfig, cfg: ExperimentConfig) -> MFCNode:
    where = f"mfcs[{i}] ({m.name})"
    try:
        cls = lookup("mfc", m.type)
    except KeyError:
        raise GraphError(f"{where}.type: unknown MFC type {m.type!r} (registered: {', '.join(registered('mfc'))})") from None
    try:
        spec = mfc_spec(m.type)
    except TypeError as e:
        raise GraphError(f"{where}.type: {e}") from None
    roles = cfg.roles()
    if m.model is None and spec.needs_model:
        raise GraphError(f"{where}.model: MFC type {m.type!r} needs a model role ({', '.join(roles)})")
    if m.model is not None and m.model not in roles:
        raise GraphError(f"{where}.model: unknown model {m.model!r} (declared roles: {', '.join(roles)})")
    trains = spec.trains
    if trains and not roles[m.model].trainable:
        raise GraphError(f"{where}.model: {m.type!r} trains, but role {m.model!r} has trainable: false")
    if spec.head is not None and m.model is not None and roles[m.model].head != spec.head:
        raise GraphError(f"{where}.model: {m.type!r} needs a role with head: {spec.head}, but role {m.model!r} "
                         f"has head: {roles[m.model].head}")
    if m.max_tokens_per_mb is not None and not spec.micro_batches:
        raise GraphError(f"{where}.max_tokens_per_mb: MFC type {m.type!r} runs no token-budgeted forward pass "
                         "(only types whose spec has micro_batches=True, e.g. inference, ppo_update, sft_update, use it)")
    _check_args(where, m, cls)
    for k in m.input_remap:
        if k not in m.inputs:
            raise GraphError(f"{where}.input_remap: {k!r} is not one of its inputs")
    for k in m.output_remap:
        if k not in m.outputs:
            raise GraphError(f"{where}.output_remap: {k!r} is not one of its outputs")
    if len(set(m.inputs)) != len(m.inputs):
        raise GraphError(f"{where}.inputs: a key is listed twice")
    outputs = tuple(m.output_remap.get(k, k) for k in m.outputs)
    return MFCNode(m.name, m.type, m.model, tuple(m.inputs), outputs, dict(m.input_remap),
                   dict(m.output_remap), m.n_seqs or cfg.trainer.batch_size, trains)


def build_graph(cfg: ExperimentConfig, source_keys: tuple[str, ...]) -> DataFlowGraph:
    """Build and validate the graph. `source_keys`: what the dataset (or stream) provides."""
    nodes: dict[str, MFCNode] = {}
    for i, m in enumerate(cfg.mfcs):
        if m.name in nodes:
            raise GraphError(f"mfcs[{i}].name: duplicate node name {m.name!r}")
        nodes[m.name] = _node(i, m, cfg)

    producer: dict[str, str] = {}
    for i, n in enumerate(nodes.values()):
        for k in n.outputs:
            if k in source_keys:
                raise GraphError(f"mfcs[{i}] ({n.name}).outputs: key {k!r} is also provided by the data source")
            if k in producer:
                raise GraphError(f"mfcs[{i}] ({n.name}).outputs: key {k!r} is already produced by {producer[k]!r}")
            producer[k] = n.name

    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    for i, n in enumerate(nodes.values()):
        for k in n.inputs:
            if k in source_keys:
                continue
            if k not in producer:
                raise GraphError(
                    f"mfcs[{i}] ({n.name}).inputs: key {k!r} has no producer "
                    f"(data source provides: {', '.join(source_keys)}; MFCs produce: {', '.join(producer) or 'nothing'})"
                )
            src = producer[k]
            if g.has_edge(src, n.name):
                g.edges[src, n.name]["keys"].append(k)
            else:
                g.add_edge(src, n.name, keys=[k])
    for i, m in enumerate(cfg.mfcs):
        check = getattr(lookup("mfc", m.type), "check_config", None)
        if check is not None:
            try:
                check(cfg, m)
            except ValueError as e:
                raise GraphError(f"mfcs[{i}] ({m.name}).{e}") from None
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        keys = ", ".join(k for u, v in cycle for k in g.edges[u, v]["keys"])
        raise GraphError(f"mfcs: cycle {path} (through keys {keys})")
    return DataFlowGraph(nodes, g, tuple(source_keys))
