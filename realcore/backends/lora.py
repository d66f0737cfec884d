"""LoRA adapters through PEFT: wrap a HF model so only the adapters train, and the conversions
every other part needs (docs/lora.md).

Two name spaces meet here. The trainer's model is a `peft.PeftModel`, whose adapter tensors PEFT
saves as `base_model.model.<module>.lora_{A,B}.weight` (adapter_model.safetensors, the format
SGLang's /load_lora_adapter and vLLM read). Servers and the merged export use plain HF names
(`<module>.weight`), so `merged_state` and `merge_adapter` give W + (alpha / r) * B @ A under
those names. `merge_adapter` needs no PEFT: the built-in server applies an adapter folder with it.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Callable

from realcore.api.config import LoraConfig
from realcore.backends import safetensors_header

# torch, peft, safetensors and transformers are imported on use: the manager and the clients import
# this module for adapter folders' names only.
if TYPE_CHECKING:
    import torch

LORA_NAME = "actor"  # the adapter's name on the generation servers of a LoRA run
ADAPTER_NAME = "default"  # PEFT's name of the one adapter a model carries
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's module names


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, *, seed: int) -> torch.nn.Module:
    """`model` wrapped by PEFT with one LoRA adapter; every base weight frozen (requires_grad False).
    PEFT draws A at random: from `seed`, so that every data-parallel rank (and a run started again)
    starts from the same adapter; the caller's random state is left as it was."""
    import torch  # on use: see TYPE_CHECKING above

    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules),
                              lora_dropout=cfg.dropout, bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, peft_cfg)
        except ValueError as e:  # e.g. no module matches target_modules
            raise ValueError(f"lora: {e}") from None


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel  # on use: see TYPE_CHECKING above

    return isinstance(model, PeftModel)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (what adapter_model.safetensors holds)."""
    from peft import get_peft_model_state_dict  # on use: see TYPE_CHECKING above

    return get_peft_model_state_dict(model)


def gathered_adapter(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """adapter_state from `state`, the wrapped model's state dict gathered elsewhere (FSDP; no
    activation checkpointing prefix). PEFT's own filter would miss them: it finds adapters by the
    live modules' names, which carry checkpoint_wrapper's `_checkpoint_wrapped_module.`."""
    return {n.replace(f".{ADAPTER_NAME}.", "."): t for n, t in state.items() if "lora_" in n}


def merged_state(model) -> dict[str, torch.Tensor]:
    """The base model's state dict (HF names, tied weights under both names, like
    `model.state_dict()` of the unwrapped model) with each adapted weight replaced by W + delta.
    The live model is not changed (merging in place and back would not restore W bit for bit)."""
    import torch  # on use: see TYPE_CHECKING above

    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    for name, t in model.get_base_model().state_dict().items():
        if "lora_" not in name:
            out[name.replace(".base_layer.", ".")] = t.detach()
    with torch.no_grad():
        for name, module in model.get_base_model().named_modules():
            if isinstance(module, LoraLayer):
                w = module.get_base_layer().weight
                out[f"{name}.weight"] = w + module.get_delta_weight(ADAPTER_NAME).to(w.dtype)
    return out


def merge_state(state: dict[str, torch.Tensor], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """merged_state from `state`, a full state dict of the wrapped model gathered elsewhere (FSDP's
    parameters are shards, so the live model cannot merge): base weights under HF names, each
    adapted one replaced by W + delta (merge_adapter: PEFT's arithmetic, equal bit for bit)."""
    base = {n.removeprefix(_PREFIX).replace(".base_layer.", "."): t for n, t in state.items() if "lora_" not in n}
    return {**base, **merge_adapter(base, adapter_config(cfg), gathered_adapter(state))}


def recover_state(model) -> dict[str, torch.Tensor]:
    """The wrapped model's state-dict entries that training changes (the adapters), for recover
    checkpoints: the frozen base is the model directory's, so it is not saved again."""
    return {n: t for n, t in model.state_dict().items() if "lora_" in n}


def load_recover_state(model, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    lost = [n for n in missing if "lora_" in n]
    if unexpected or lost:
        raise ValueError(f"lora: the recover state does not fit this model's adapters (unexpected {unexpected[:3]}, "
                         f"missing {lost[:3]})")


def save_adapter(model, path: str, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """adapter_model.safetensors + adapter_config.json in `path` (PEFT's format); `tensors`: the
    adapter under PEFT's saved names when the caller gathered it (FSDP, see gathered_adapter), which
    replace the empty set PEFT then finds in the live model."""
    if tensors is None:
        model.save_pretrained(path)
        return
    model.save_pretrained(path, state_dict={})  # the config and model card, as PEFT writes them
    from safetensors.torch import save_file  # on use: see TYPE_CHECKING above

    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})


def save_merged(model, path: str, state: dict[str, torch.Tensor] | None = None) -> None:
    """A plain HF checkpoint of base + adapter in `path`, loadable by transformers without PEFT;
    `state`: the merged weights when the caller has them (FSDP gathers them), else merged_state."""
    import torch  # on use: see TYPE_CHECKING above

    from transformers import AutoModelForCausalLM

    base = model.get_base_model()
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(base.config, dtype=next(base.parameters()).dtype)
    state = merged_state(model) if state is None else state
    plain.load_state_dict({k: v.detach().clone() for k, v in state.items()}, assign=True)
    plain.tie_weights()
    plain.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(path)


def adapter_config(cfg: LoraConfig) -> dict:
    """The adapter_config.json fields that say how to apply an adapter trained with `cfg`
    (apply_lora's PEFT settings: no rsLoRA, weights stored (out, in))."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "target_modules": sorted(cfg.target_modules), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False}


def check_config(cfg) -> dict:
    """An adapter config (adapter_config.json, or one sent with in-memory tensors) that
    merge_adapter can apply; ValueError otherwise."""
    if not isinstance(cfg, dict):
        raise ValueError("lora: the adapter config is not a mapping")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora: a {cfg.get('peft_type')} adapter, not LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(r) is not int or r <= 0 or type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise ValueError(f"lora: the adapter config needs r (an int > 0) and lora_alpha (a number), got {r!r}, {alpha!r}")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("use_dora"):
        raise ValueError("lora: rank_pattern, alpha_pattern and DoRA are not supported")
    return cfg


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def read_adapter(path: str, shapes: dict[str, tuple[int, ...]] | None = None,
                 check: Callable[[dict], None] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT LoRA folder; ValueError if it is not one. With
    `shapes` (the base model's {HF name: shape}), the tensors' header is checked against them
    (check_header) and `check(config)` runs before any tensor is read."""
    cfg_file, weights = os.path.join(path, ADAPTER_CONFIG), os.path.join(path, ADAPTER_WEIGHTS)
    if not (os.path.isfile(cfg_file) and os.path.isfile(weights)):
        raise ValueError(f"lora: {path!r} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (ValueError, OSError) as e:  # json's errors are ValueErrors
        raise ValueError(f"lora: {cfg_file}: {e}") from None
    try:
        check_config(cfg)
    except ValueError as e:
        raise ValueError(f"{e} ({path!r})") from None
    if check is not None:
        check(cfg)
    if shapes is not None:
        check_header(weights, cfg, shapes)
    from safetensors import SafetensorError  # on use: see TYPE_CHECKING above
    from safetensors.torch import load_file

    try:
        return cfg, load_file(weights)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"lora: {weights}: {e}") from None


def check_header(weights: str, cfg: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming `weights` unless its header (read without the tensors) holds, for every
    lora_A, a lora_B of the same rank whose B @ A has its base weight's shape (merge_adapter's rules)."""
    entries = safetensors_header.header(weights)
    for key, (dtype, a) in entries.items():
        if dtype not in safetensors_header.FLOATS:
            raise ValueError(f"lora: {weights}: tensor {key!r} is {dtype}, not floating-point")
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        b = entries.get(f"{module}.lora_B.weight", (None, None))[1]
        name = f"{module.removeprefix(_PREFIX)}.weight"
        if b is None or name not in shapes:
            raise ValueError(f"lora: {weights}: adapter tensor {key!r} has no lora_B or no base weight {name!r}")
        w = tuple(shapes[name][::-1]) if cfg.get("fan_in_fan_out") else tuple(shapes[name])  # what B @ A must be
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or (b[0], a[1]) != w:
            raise ValueError(f"lora: {weights}: {module}: lora_A {a} and lora_B {b} do not make the base weight "
                             f"{name} {tuple(shapes[name])}")
    if not any(k.endswith(".lora_A.weight") for k in entries):
        raise ValueError(f"lora: {weights}: the adapter holds no lora_A / lora_B tensors")


def merge_adapter(base: dict[str, torch.Tensor], cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{HF weight name: base + scale * B @ A} for every module the adapter changes (PEFT's
    get_delta_weight: scale = alpha / r, or alpha / sqrt(r) with rsLoRA; transposed when
    fan_in_fan_out). `base` holds at least those weights, under HF names."""
    import torch  # on use: see TYPE_CHECKING above

    r = int(cfg["r"])
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    out: dict[str, torch.Tensor] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        b = tensors.get(f"{module}.lora_B.weight")
        name = f"{module.removeprefix(_PREFIX)}.weight"
        if b is None or name not in base:
            raise ValueError(f"lora: adapter tensor {key!r} has no lora_B or no base weight {name!r}")
        w = base[name]
        delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)  # (out, r) @ (r, in)
        if cfg.get("fan_in_fan_out"):
            delta = delta.T
        if tuple(delta.shape) != tuple(w.shape):
            raise ValueError(f"lora: {name}: the adapter's B @ A is {tuple(delta.shape)}, the weight {tuple(w.shape)}")
        out[name] = w + (delta * scale).to(w.dtype)
    if not out:
        raise ValueError("lora: the adapter holds no lora_A / lora_B tensors")
    return out


def write_zero_adapter(model_path: str, cfg: LoraConfig, path: str) -> str:
    """A PEFT adapter folder for `model_path` whose every A and B is zero: it changes nothing, as
    the trainer's initial adapter (PEFT starts B at zero). SGLang servers start with it loaded
    (--lora-paths), so requests can name the adapter before the first update. Shapes come from the
    model's config alone (a meta-device model), so no weights are read. Returns `path`."""
    import torch  # on use: see TYPE_CHECKING above

    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in cfg.target_modules:
            tensors[f"{_PREFIX}{name}.lora_A.weight"] = torch.zeros(cfg.rank, module.in_features)
            tensors[f"{_PREFIX}{name}.lora_B.weight"] = torch.zeros(module.out_features, cfg.rank)
    if not tensors:
        raise ValueError(f"lora: no Linear module of {model_path!r} is named one of {cfg.target_modules}")
    config = {**adapter_config(cfg), "base_model_name_or_path": model_path}
    # Each file by rename: servers started one after another may read it while the next writes it.
    os.makedirs(path, exist_ok=True)
    tmp = f".tmp-{os.getpid()}"
    from safetensors.torch import save_file  # on use: see TYPE_CHECKING above

    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS + tmp))
    with open(os.path.join(path, ADAPTER_CONFIG + tmp), "w") as f:
        json.dump(config, f, indent=2)
    os.replace(os.path.join(path, ADAPTER_WEIGHTS + tmp), os.path.join(path, ADAPTER_WEIGHTS))
    os.replace(os.path.join(path, ADAPTER_CONFIG + tmp), os.path.join(path, ADAPTER_CONFIG))
    return path


def sglang_flags(cfg: LoraConfig, initial_adapter: str, name: str) -> list[str]:
    """SGLang's launch flags for serving the adapter `name` (SGLang 0.5 server args: LoRA is off
    unless enabled; rank and target modules bound what /load_lora_adapter may load later)."""
    return ["--enable-lora", "--max-lora-rank", str(cfg.rank), "--lora-target-modules", *cfg.target_modules,
            "--lora-paths", f"{name}={initial_adapter}"]
