"""Master.chain: which MFCs go in one request with the MFC being sent.

The master here is built without its sockets (the chain decision reads only the graph, the
sample buffer and the mesh); bench/master_scale.py and the e2e runs drive chained requests over
the real wire."""

from realcore.api.alloc import parse_allocation_mode
from realcore.dfg.graph import build_graph
from realcore.launch.config_loader import load_config
from realcore.api.registry import source_keys
from realcore.trainer.buffer import SampleBuffer, split_balanced
from realcore.trainer.master import Master, MeshView
from realcore.launch.plugins import load_plugins
from test_buffer import sizes


def _master(dp: int = 2, allocation_mode: str | None = None) -> Master:
    load_plugins([])
    cfg = load_config(["experiment=ppo-math", "model=tiny", f"allocation_mode={allocation_mode or f'd{dp}p1t1'}",
                       "output_dir=/tmp/unused"])
    m = object.__new__(Master)
    m.cfg, m.alloc = cfg, parse_allocation_mode(cfg.allocation_mode)
    m.mesh = m.alloc.train
    m.policy = cfg.policy_role()
    m.meshes = [MeshView(i, mesh, mesh.heads(), [[d] for d in range(mesh.dims.dp)])
                for i, mesh in enumerate(m.alloc.meshes(cfg.roles()))]
    m.mesh_of_role = {role: v for v in m.meshes for role in v.mesh.roles}
    m.dfg = build_graph(cfg, source_keys(cfg))
    m.nodes = [m.dfg.nodes[n] for n in m.dfg.order()]
    m.buffer = SampleBuffer(m.nodes)
    return m


def _generated(m: Master, ids: list[int], lens: dict[int, int]) -> None:
    """Samples as after actor_gen: prompts from worker 0, generated keys on worker 1."""
    m.buffer.add([0] * len(ids), ids, *sizes({"prompt_ids": [[5]] * len(ids), "answer": [[1]] * len(ids)}))
    gen = m.dfg.nodes["actor_gen"]
    m.buffer.add([1] * len(ids), ids, *sizes({k: [[lens[sid]] * 4 for sid in ids] for k in gen.outputs}))
    m.buffer.finish(gen, ids)


def _parts(m: Master, node: str, ids: list[int]) -> list[list[int]]:
    inputs = m.dfg.nodes[node].inputs
    return split_balanced(ids, m.buffer.costs(ids, inputs), m.mesh.dp)


def test_training_rides_with_reference_logprobs_not_with_generation():
    m = _master()
    n = m.dfg.nodes["actor_gen"].n_seqs
    ids = list(range(n))
    m.buffer.add([0] * len(ids), ids, *sizes({"prompt_ids": [[5]] * n, "answer": [[1]] * n}))
    # Generation makes the responses later MFCs are balanced by: nothing is chained to it.
    assert m.chain(m.dfg.nodes["actor_gen"], ids, _parts(m, "actor_gen", ids), set()) == []

    m = _master()
    _generated(m, ids, {sid: 10 + 7 * sid for sid in ids})
    ref = m.dfg.nodes["ref_inf"]
    chained = m.chain(ref, ids, _parts(m, "ref_inf", ids), set())
    assert [b.name for b in chained] == ["actor_train"]
    # ... unless it is already being sent, or runs on other ids.
    assert m.chain(ref, ids, _parts(m, "ref_inf", ids), {"actor_train"}) == []
    assert m.chain(ref, ids[:-1], _parts(m, "ref_inf", ids[:-1]), set()) == []


def test_an_mfc_split_differently_is_not_chained():
    m = _master()
    ids = list(range(m.dfg.nodes["actor_gen"].n_seqs))
    _generated(m, ids, {sid: 10 + 7 * sid for sid in ids})
    # actor_train's cost is its longest input: a loss mask longer than the sequences for some
    # samples changes its balanced split, so it must wait and be split by its own costs.
    half = ids[: len(ids) // 2]
    m.buffer.add([1] * len(half), half, *sizes({"loss_mask": [[(10 + 7 * sid) * 50] * 4 for sid in half]}))
    parts = _parts(m, "ref_inf", ids)
    assert parts != _parts(m, "actor_train", ids)
    assert m.chain(m.dfg.nodes["ref_inf"], ids, parts, set()) == []


def test_an_mfc_on_another_mesh_is_not_chained():
    m = _master(allocation_mode="actor:d2p1t1,ref:d2p1t1")
    ids = list(range(m.dfg.nodes["actor_gen"].n_seqs))
    _generated(m, ids, {sid: 10 + 7 * sid for sid in ids})
    # ref_inf runs on ref's mesh, actor_train on the actor's: each goes to its own workers.
    assert m.mesh_of(m.dfg.nodes["ref_inf"]).index == 1 and m.mesh_of(m.dfg.nodes["actor_train"]).index == 0
    assert m.chain(m.dfg.nodes["ref_inf"], ids, _parts(m, "ref_inf", ids), set()) == []
