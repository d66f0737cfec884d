"""generate lists `question` and `fields` (a row's other fields) among its inputs in the built-in
experiments; a user's dataset that has neither still runs them: the launcher drops an MFC's
optional inputs (MFCSpec.optional_inputs) that nothing provides."""

from realcore.api.registry import register_dataset, source_keys
from realcore.dfg.graph import build_graph
from realcore.dfg.prune import drop_unread_mfcs
from realcore.launch.config_loader import load_config


@register_dataset("test-optional-inputs-prompts", keys=("prompt_ids", "answer"))
def _prompts_and_answers(cfg, tokenizer, *, rank, world, use_chat_template):
    raise AssertionError("not loaded: only the graph is built")


def gen_inputs(cfg) -> list[str]:
    return next(m.inputs for m in cfg.mfcs if m.name == "actor_gen")


def test_a_dataset_without_question_or_fields_builds_the_built_in_graph():
    cfg = load_config(["experiment=ppo-math", "dataset.type=test-optional-inputs-prompts"])
    assert gen_inputs(cfg) == ["prompt_ids", "answer", "question", "fields"]  # as the YAML lists them
    drop_unread_mfcs(cfg)
    assert gen_inputs(cfg) == ["prompt_ids", "answer"]
    build_graph(cfg, source_keys(cfg))  # no "key 'fields' has no producer"


def test_a_built_in_dataset_keeps_them():
    cfg = load_config(["experiment=ppo-math"])
    drop_unread_mfcs(cfg)
    assert gen_inputs(cfg) == ["prompt_ids", "answer", "question", "fields"]


def test_a_required_input_nothing_provides_is_still_an_error():
    import pytest

    from realcore.dfg.graph import GraphError

    cfg = load_config(["experiment=ppo-math", "dataset.type=test-optional-inputs-prompts"])
    drop_unread_mfcs(cfg)
    cfg.mfcs[0].inputs.append("no_such_key")
    with pytest.raises(GraphError, match="no_such_key"):
        build_graph(cfg, source_keys(cfg))
