"""Config composition and validation; dataflow graph build, validation, drawing."""

import pytest

from realcore.api.alloc import ParallelDims, parse_allocation_mode
from realcore.api.registry import dataset_keys
from realcore.dfg.draw import draw
from realcore.dfg.graph import GraphError, build_graph
from realcore.launch.config_loader import ConfigError, import_user_modules, load_config


def cfg_with(*overrides):
    cfg = load_config(["experiment=ppo-math", "output_dir=/tmp/unused", *overrides])
    import_user_modules(cfg)
    return cfg


def test_compose_defaults_and_overrides():
    cfg = cfg_with("trainer.total_steps=3", "model=tiny", "generation.n_samples=2")
    assert cfg.trainer.total_steps == 3 and cfg.generation.n_samples == 2
    assert [m.name for m in cfg.mfcs] == ["actor_gen", "ref_inf", "actor_train"]
    assert cfg.ref is not None and not cfg.ref.trainable


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.totl_steps=5", "trainer.totl_steps: unknown key"),
        ("+trainer.zz=1", "trainer.zz: unknown key"),
        ("trainer.total_steps=abc", "trainer.total_steps: Input should be a valid integer"),
        ("trainer.total_steps=-1", "trainer.total_steps: Input should be greater than 0"),
        ("model=nope", "model=nope: no such model config (available: smollm2-135m, tiny)"),
        ("mfcs.0.type=1", "mfcs[0].type: Input should be a valid string"),
        ("notakeyvalue", "expected key=value"),
    ],
)
def test_bad_config_is_one_clear_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(["experiment=ppo-math", override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("experiment", ["ppo-math", "with-eval"])  # eval.dataset unset / set by the experiment
def test_a_mapping_on_the_command_line_replaces_an_optional_sub_config(experiment, tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "with-eval.yaml").write_text(
        "# @package _global_\ndefaults:\n  - ppo-math\neval:\n  dataset: {type: reasoning-gym, size: 64, task_kwargs: {min_terms: 3}}\n")
    base = [f"hydra.searchpath=[file://{tmp_path}]", f"experiment={experiment}"]
    d = load_config([*base, "eval.dataset={type: jsonl, path: /data/test.jsonl}"]).eval.dataset
    assert (d.type, d.path, d.size, d.task_kwargs) == ("jsonl", "/data/test.jsonl", 256, {})
    if experiment == "with-eval":  # one key of the experiment's mapping still changes alone
        d = load_config([*base, "eval.dataset.size=7"]).eval.dataset
        assert (d.type, d.size, d.task_kwargs) == ("reasoning-gym", 7, {"min_terms": 3})


def test_graph_from_ppo_math():
    cfg = cfg_with()
    dfg = build_graph(cfg, dataset_keys(cfg.dataset))
    assert dfg.order() == ["actor_gen", "ref_inf", "actor_train"]
    assert dfg.levels() == [["actor_gen"], ["ref_inf"], ["actor_train"]]
    assert dfg.nodes["ref_inf"].outputs == ("ref_logprobs",)
    assert sorted(dfg.graph.edges["actor_gen", "actor_train"]["keys"]) == ["behav_logprobs", "input_ids", "loss_mask", "rewards"]


def test_generate_writes_only_what_the_workflow_declares():
    cfg = cfg_with()
    mfcs = _mfcs(cfg)
    mfcs[0]["outputs"].append("values")
    with pytest.raises(GraphError, match=r"outputs \['values'\] are not produced by workflow 'math-single-step'"):
        _rebuild(cfg, mfcs)


def _mfcs(cfg):
    return [m.model_dump() for m in cfg.mfcs]


def _rebuild(cfg, mfcs):
    bad = cfg.model_copy(update={"mfcs": [type(cfg.mfcs[0]).model_validate(m) for m in mfcs]})
    return build_graph(bad, dataset_keys(bad.dataset))


def test_missing_producer_names_node_and_key():
    cfg = cfg_with()
    mfcs = _mfcs(cfg)
    mfcs[2]["inputs"][3] = "rewardz"
    with pytest.raises(GraphError, match=r"mfcs\[2\] \(actor_train\).inputs: key 'rewardz' has no producer"):
        _rebuild(cfg, mfcs)


def test_cycle_is_rejected():
    cfg = cfg_with()
    mfcs = _mfcs(cfg)
    mfcs[0]["inputs"] = ["prompt_ids", "rewards"]  # generate now depends on reward, which depends on it
    with pytest.raises(GraphError, match=r"cycle .*actor_gen.*reward"):
        _rebuild(cfg, mfcs)


def test_duplicate_producer_unknown_type_unknown_model():
    cfg = cfg_with()
    mfcs = _mfcs(cfg)
    mfcs[1]["output_remap"] = {"logprobs": "rewards"}
    with pytest.raises(GraphError, match=r"mfcs\[1\] \(ref_inf\).outputs: key 'rewards' is already produced by 'actor_gen'"):
        _rebuild(cfg, mfcs)
    mfcs = _mfcs(cfg)
    mfcs[0]["type"] = "generat"
    with pytest.raises(GraphError, match=r"mfcs\[0\] \(actor_gen\).type: unknown MFC type 'generat'"):
        _rebuild(cfg, mfcs)
    mfcs = _mfcs(cfg)
    mfcs[1]["model"] = "critic"
    with pytest.raises(GraphError, match=r"mfcs\[1\] \(ref_inf\).model: unknown model 'critic'"):
        _rebuild(cfg, mfcs)
    mfcs = _mfcs(cfg)
    mfcs[2]["inputs"].remove("ref_logprobs")
    with pytest.raises(GraphError, match=r"ppo.kl_coef > 0"):
        _rebuild(cfg, mfcs)


def test_mfc_max_tokens_per_mb_only_where_it_micro_batches():
    cfg = cfg_with()
    mfcs = _mfcs(cfg)
    mfcs[1]["max_tokens_per_mb"] = 64  # ref_inf (inference) and actor_train (ppo_update) take it
    mfcs[2]["max_tokens_per_mb"] = 128
    _rebuild(cfg, mfcs)
    reward = {"name": "score", "type": "reward", "inputs": ["input_ids", "loss_mask", "answer"], "outputs": ["score"]}
    for i, (name, mfc_type) in enumerate([("actor_gen", "generate"), ("score", "reward")]):
        mfcs = _mfcs(cfg)
        mfcs.insert(1, dict(reward))
        mfcs[i]["max_tokens_per_mb"] = 64
        where = rf"mfcs\[{i}\] \({name}\).max_tokens_per_mb"
        with pytest.raises(GraphError, match=rf"{where}: MFC type '{mfc_type}' runs no"):
            _rebuild(cfg, mfcs)


def test_gradient_checkpointing_needs_a_trainable_role():
    with pytest.raises(ConfigError, match="ref: .*gradient_checkpointing: only a trainable role"):
        load_config(["experiment=ppo-math", "++ref.gradient_checkpointing=true"])
    assert cfg_with("actor.gradient_checkpointing=true").actor.gradient_checkpointing


def test_registries_are_the_documented_extension_points():
    from realcore.api import registry

    assert sorted(registry._REGISTRIES) == ["dataset", "engine", "env", "mfc", "reward", "workflow"]  # engine: generation engines, from a user file too
    assert not hasattr(registry, "register_agent")  # agents are workflows


def test_user_mfc_registered_from_yaml(tmp_path, monkeypatch):
    (tmp_path / "my_mfcs.py").write_text(
        "from realcore.api.registry import MFCSpec, register_mfc\n"
        "@register_mfc('length_bonus')\n"
        "class LengthBonus:\n"
        "    spec = MFCSpec(needs_model=False)\n"
        "    def __init__(self, cfg, mfc): pass\n"
        "    def run(self, model, batch): return {}\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = cfg_with("imports=[my_mfcs]")
    mfcs = _mfcs(cfg) + [{"name": "bonus", "type": "length_bonus", "inputs": ["input_ids"]}]
    dfg = _rebuild(cfg, mfcs)
    assert "bonus" in dfg.nodes and dfg.graph.has_edge("actor_gen", "bonus")


def test_draw_png(tmp_path):
    cfg = cfg_with()
    path = tmp_path / "dfg.png"
    draw(build_graph(cfg, dataset_keys(cfg.dataset)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_allocation_mode():
    assert parse_allocation_mode("d2p1t1").train == ParallelDims(dp=2)
    a = parse_allocation_mode("local.d1p1t1+d2p2t2c1e1")
    assert a.backend == "local" and a.gen == ParallelDims() and a.train.world_size == 8
    assert parse_allocation_mode("d4m2").train.tp == 2
    with pytest.raises(ValueError, match="cannot parse"):
        parse_allocation_mode("x2")
