"""Roles as data: any number of named roles, each on its own training mesh or the actor's
(allocation_mode ROLE:MESH,...), checked when the config is read."""

import pytest

from realcore.api.alloc import mesh_of_role, mesh_of_worker, parse_allocation_mode
from realcore.api.config import ExperimentConfig, config_keys
from realcore.dfg.graph import GraphError, build_graph
from realcore.api.registry import source_keys
from realcore.launch.placement import process_names
from realcore.launch.plugins import load_plugins

TRAIN = [{"name": "actor_train", "type": "sft_update", "model": "actor", "inputs": ["input_ids", "loss_mask"]}]


def cfg(**kw) -> ExperimentConfig:
    return ExperimentConfig(**{"experiment_name": "x", "output_dir": "/tmp/roles-unused", "mfcs": TRAIN, **kw})


def test_named_roles_come_after_actor_and_ref():
    c = cfg(ref={}, roles={"critic": {"head": "value", "trainable": True, "model_path": "/models/critic"},
                           "judge": {"head": "score"}}, model={"path": "/models/base"})
    assert list(c.roles()) == ["actor", "ref", "critic", "judge"]
    assert c.policy_role() == "actor"
    assert c.roles()["critic"].head == "value" and c.roles()["judge"].head == "score"
    assert c.role_model_path("critic") == "/models/critic"
    assert c.role_model_path("judge") == c.role_model_path("actor") == "/models/base"
    # Written as the launcher writes it and read back as every worker reads it: `roles`, not roles_.
    text = c.model_dump_json()
    assert '"roles"' in text and "roles_" not in text
    assert list(ExperimentConfig.model_validate_json(text).roles()) == ["actor", "ref", "critic", "judge"]
    assert "roles.head" in config_keys() and not any(k.startswith("roles_") for k in config_keys())


@pytest.mark.parametrize("kw, message", [
    ({"roles": {"actor": {}}}, "roles.actor: the role 'actor' is given twice"),
    ({"ref": {}, "roles": {"ref": {}}}, "roles.ref: the role 'ref' is given twice"),
    ({"allocation_mode": "actor:d1,critic:d1"}, "allocation_mode: unknown role 'critic' (declared roles: actor)"),
])
def test_a_role_named_twice_or_unknown_is_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        cfg(**kw)
    assert message in str(e.value)


def test_an_mfc_on_an_unknown_role_is_refused():
    load_plugins([])
    c = cfg(mfcs=[{"name": "critic_inf", "type": "inference", "model": "critic", "inputs": ["input_ids"],
                   "outputs": ["logprobs"]}])
    with pytest.raises(GraphError, match=r"unknown model 'critic' \(declared roles: actor\)"):
        build_graph(c, source_keys(c))


def test_plain_mesh_keeps_every_role_on_it():
    a = parse_allocation_mode("d2p1t1")
    meshes = a.meshes(["actor", "ref", "critic"])
    assert len(meshes) == 1 and meshes[0].roles == ("actor", "ref", "critic") and a.world_size == 2
    assert meshes[0].heads() == [0, 1]


def test_per_role_meshes_are_numbered_actor_first():
    a = parse_allocation_mode("local.d1p1t1+ref:d2p1t1,actor:d1p1t1,critic:d1p2t1")
    assert a.backend == "local" and a.gen.dp == 1
    assert a.train.dp == 1 and a.world_size == 1 + 2 + 2
    meshes = a.meshes(["actor", "ref", "critic", "judge"])
    # The actor's mesh first (worker 0 is the policy's rank 0), with every role not named.
    assert [(m.roles, m.first, m.dims.world_size) for m in meshes] == [
        (("actor", "judge"), 0, 1), (("ref",), 1, 2), (("critic",), 3, 2)]
    assert [mesh_of_worker(meshes, i).roles for i in range(5)] == [("actor", "judge"), ("ref",), ("ref",),
                                                                   ("critic",), ("critic",)]
    assert mesh_of_role(meshes, "judge") is meshes[0] and mesh_of_role(meshes, "ref").heads() == [1, 2]
    assert meshes[2].heads() == [3]  # pp 2: one replica, its head the first stage


@pytest.mark.parametrize("mode, message", [
    ("actor:d1,actor:d2", "role 'actor' is given a mesh twice"),
    ("ref:d1,critic:d1", "places roles but not the actor"),
    ("actor:d1,:d1", "is not ROLE:MESH"),
    ("actor:d1,ref:x3", "cannot parse mesh 'x3'"),
    ("local.d1+actor:d1+ref:d1", "at most 2"),
])
def test_bad_per_role_allocation_is_one_line(mode, message):
    with pytest.raises(ValueError, match="allocation_mode") as e:
        parse_allocation_mode(mode)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_backend_default_follows_the_roles_own_mesh():
    c = cfg(ref={}, roles={"critic": {"trainable": True}, "judge": {}}, allocation_mode="actor:d1,critic:d1p2t1,ref:d2")
    backends = {r: rc.backend for r, rc in c.roles().items()}
    # critic's own mesh splits the model: megatron; ref's is data parallel: torch; judge shares the actor's.
    assert backends == {"actor": "torch", "ref": "torch", "critic": "megatron", "judge": "torch"}
    c = cfg(ref={}, actor={"backend": "fsdp", "trainable": True}, allocation_mode="actor:d2,ref:d1")
    assert c.ref.backend == "torch"  # its own mesh: not the actor's fsdp
    c = cfg(ref={}, actor={"backend": "fsdp", "trainable": True}, allocation_mode="d2")
    assert c.ref.backend == "fsdp"  # colocated: the actor's


def test_the_launcher_starts_every_meshs_workers():
    c = cfg(ref={}, allocation_mode="actor:d1p1t1,ref:d2p1t1")
    names = process_names(c, parse_allocation_mode(c.allocation_mode))
    assert names == ["model_worker/0", "model_worker/1", "model_worker/2", "master"]


def test_per_role_allocation_on_the_command_line_needs_no_quotes():
    from realcore.launch.config_loader import load_config

    load_plugins([])
    c = load_config(["experiment=ppo-math", "model=tiny", "output_dir=/tmp/roles-unused", "allocation_mode=actor:d1,ref:d2"])
    assert c.allocation_mode == "actor:d1,ref:d2" and parse_allocation_mode(c.allocation_mode).world_size == 3


def test_the_meshes_are_described_with_their_workers():
    from realcore.launch.placement import describe_meshes

    c = cfg(ref={}, roles={"critic": {"trainable": True}}, allocation_mode="actor:d2p1t1,critic:d1p2t1")
    assert describe_meshes(c, parse_allocation_mode(c.allocation_mode)).splitlines()[1:] == [
        "  actor, ref: model_worker/0-1 (d2p1t1c1e1)", "  critic: model_worker/2-3 (d1p2t1c1e1)"]
