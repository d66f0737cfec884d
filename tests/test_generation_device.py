"""The built-in engine on the device its model is on: what a GPU needs, tested on the CPU through the
same functions (only the device differs), plus GPU-only checks that skip without CUDA.

- Host syncs: on a GPU every read of a tensor's value on the host waits for the queued kernels. A
  TorchFunctionMode counts such reads (`HostReads`) during each decode step, with the engine on the
  search a GPU takes (`sync_free=True`): at most one per step (its tokens and log-probs), for greedy,
  plain, top-k/top-p and mixed batches. A pageable host-to-device copy (also a sync on a GPU) cannot
  be seen on a CPU; the CUDA test checks those with torch's sync debug mode.
- Devices: every tensor the engine makes names its device, shown by running it under
  `torch.set_default_device("meta")`: a tensor made without one would be a meta tensor, and the
  step would fail on it.
- `python -m realcore.serve --device cuda` and `run_server(device="cuda")` without a GPU: one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from realcore.api.config import GenerationConfig
from realcore.backends import generation
from realcore.backends.generation import GenerationEngine, sample_tokens
from test_generation import model_tok  # noqa: F401  (the fixture: tiny model, weights spread out)

torch.set_num_threads(1)
TEXTS = ["Question: What is 3 + 5?\nAnswer:", "hi", "the cat has many apples and the dogs have more books so", "7",
         "she buys eggs", "Question: What is 12 * 4?\nAnswer: let us"]

# Tensor methods and torch functions that hand a tensor's values to the host.
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "nonzero", "argwhere",
         "cpu", "numpy", "masked_select", "unique", "unique_consecutive", "bincount", "repeat_interleave"}


def _bool_index(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReads(TorchFunctionMode):
    """Counts every read of a tensor's values on the host (a sync on an accelerator)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in READS
                or (name in ("__getitem__", "__setitem__") and _bool_index(args[1]))  # a boolean mask: nonzero
                or (name in ("index_put", "index_put_") and _bool_index(args[1]))
                or (name == "where" and len(args) + len(kwargs) == 1)):
            self.names.append(name)
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def prompts(model_tok):
    return [model_tok[1](t)["input_ids"] for t in TEXTS]


KINDS = {
    "greedy": [dict(greedy=True)],
    "plain": [dict(temperature=1.0), dict(temperature=0.7)],
    "top_k_top_p": [dict(top_p=0.8), dict(top_k=7, top_p=0.9, temperature=0.8), dict(top_k=3)],
    "mixed": [dict(greedy=True), dict(temperature=0.7), dict(top_p=0.8), dict(top_k=5)],
}


def _configs(kind: str, n: int) -> list[GenerationConfig]:
    """n settings of `kind`, in turn, with different lengths: rows leave the batch at different steps."""
    return [GenerationConfig(**KINDS[kind][i % len(KINDS[kind])], max_new_tokens=6 + 3 * i, max_batch_size=16,
                             ignore_eos=True) for i in range(n)]


def _count_reads(engine: GenerationEngine, prompts, gconfigs) -> tuple[list[str], list[list[str]]]:
    """Host reads of the first step (every request's prefill) and of each later (decode) step."""
    for p, g in zip(prompts, gconfigs):
        engine.add_request(p, g)
    with HostReads() as reads:
        engine.step()
    assert engine.n_running() == len(prompts)  # all admitted at once: every later step only decodes
    first, steps = reads.names, []
    while engine.has_unfinished():
        with HostReads() as reads:
            engine.step()
        steps.append(reads.names)
    return first, steps


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_decode_step_reads_the_device_once(model_tok, prompts, kind):
    """The engine on a GPU's search (sync_free, set by hand on this CPU engine): one read per decode
    step (tokens and log-probs in one copy), and a few in the prefill (HF's mask code, the sampled
    first tokens)."""
    model, tok = model_tok
    engine = GenerationEngine(model, tok, seed=3)
    assert not engine.sync_free  # a CPU engine widens its top-p search by reading the tensors
    engine.sync_free = True
    first, steps = _count_reads(engine, prompts, _configs(kind, len(prompts)))
    assert len(steps) > 10
    assert all(names == ["tolist"] for names in steps), steps
    assert len(first) <= 3, first


@pytest.mark.parametrize("kind", list(KINDS))
def test_cpu_and_gpu_searches_sample_alike(model_tok, prompts, kind):
    """The CPU's widening top-p search and the full sort of the sync-free one draw the same tokens."""
    model, tok = model_tok
    out = []
    for sync_free in (False, True):
        engine = GenerationEngine(model, tok, seed=5)
        engine.sync_free = sync_free
        rids = [engine.add_request(p, g) for p, g in zip(prompts, _configs(kind, len(prompts)))]
        done = {}
        while engine.has_unfinished():
            done.update(engine.step())
        out.append([(done[r].output_ids, done[r].output_logprobs) for r in rids])
    assert out[0] == out[1]


def test_sampling_over_a_large_vocabulary_reads_nothing():
    """sample_tokens itself reads nothing, also where the inverse CDF runs in two levels (a 5k
    vocabulary) and rows of every kind share a batch; the samples are possible tokens of each rule."""
    V, B = 5000, 8
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, V - 300 :] = float("-inf")  # a zero-probability tail: never drawn
    kinds = [dict(greedy=True), dict(), dict(top_k=3), dict(top_p=0.5), dict(top_k=50, top_p=0.9),
             dict(temperature=0.5), dict(greedy=True), dict(top_p=0.99)]
    settings = dict(temperature=[k.get("temperature", 1.0) for k in kinds], top_k=[k.get("top_k", 0) for k in kinds],
                    top_p=[k.get("top_p", 1.0) for k in kinds], greedy=[k.get("greedy", False) for k in kinds])
    for rows in (list(range(B)), [1, 5], [2, 3, 4, 7], [0, 6]):  # mixed, plain, filtered, greedy alone
        pick = lambda values: [values[i] for i in rows]  # noqa: E731
        for draw in range(20):
            rngs = [torch.Generator().manual_seed(100 * draw + i) for i in rows]
            with HostReads() as reads:
                tokens, logprobs = sample_tokens(logits[rows], rngs=rngs, sync_free=True,
                                                 **{k: pick(v) for k, v in settings.items()})
            assert reads.names == []
            for t, lp, i in zip(tokens.tolist(), logprobs.tolist(), rows):
                assert t < V - 300 and lp > -float("inf")
                order = logits[i].argsort(descending=True).tolist()
                if settings["greedy"][i] or settings["top_k"][i] == 3:
                    assert order.index(t) < (1 if settings["greedy"][i] else 3)


def test_every_tensor_names_its_device(model_tok, prompts):
    """Under a default device of "meta", a tensor made without naming a device would be a meta
    tensor and the step would fail on it: the engine gives the same tokens as without. The KV cache,
    the generators and the sampled tokens are on the engine's device."""
    model, tok = model_tok
    gconfig = GenerationConfig(temperature=0.9, top_p=0.8, max_new_tokens=8, max_batch_size=4)
    expected = [r.output_ids for r in GenerationEngine(model, tok, seed=1).generate(prompts, gconfig)]
    engine = GenerationEngine(model, tok, seed=1)
    seen: list[torch.device] = []
    sample = generation.sample_tokens

    def spy(logits, **kw):
        tokens, logprobs = sample(logits, **kw)
        seen.extend([tokens.device, logprobs.device, *(g.device for g in kw["rngs"])])
        seen.extend(t.device for t in engine._kv.keys + engine._kv.values)
        return tokens, logprobs

    generation.sample_tokens = spy
    torch.set_default_device("meta")
    try:
        got = [r.output_ids for r in engine.generate(prompts, gconfig)]
    finally:
        torch.set_default_device(None)
        generation.sample_tokens = sample
    assert got == expected
    assert seen and {d.type for d in seen} == {engine.device.type}


def test_serve_device_cuda_without_a_gpu_is_one_line(tmp_path):
    """--device cuda where the process sees no GPU (CUDA_VISIBLE_DEVICES="" hides a GPU machine's):
    exit 2 and one line, before any model is read."""
    from realcore.serve import parse_args

    assert parse_args(["--model-path", "m"]).device == "auto"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "realcore.serve", "--model-path", str(tmp_path / "none"),
                           "--device", "cuda"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("python -m realcore.serve: error: --device cuda: ") and "no CUDA GPU" in proc.stderr


def test_run_server_cuda_without_a_gpu_raises_one_line(monkeypatch):
    """The process sees no GPU (on a GPU machine: torch told so, the way CUDA_VISIBLE_DEVICES=""
    would at start-up)."""
    from realcore.backends.genserver.http import run_server

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    with pytest.raises(ValueError) as e:
        run_server("/nonexistent", token="t", device="cuda")
    assert "\n" not in str(e.value) and "no CUDA GPU" in str(e.value)


def test_nccl_receives_on_the_models_device_and_gloo_on_the_cpu():
    from realcore.backends.genserver.weight_intake import receive_device

    gpu = torch.device("cuda", 0)  # a name only: no CUDA tensor is made
    assert receive_device("nccl", gpu) == gpu
    assert receive_device("gloo", gpu) == torch.device("cpu")
    assert receive_device("gloo", torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="backend nccl: this server's model is not on a GPU"):
        receive_device("nccl", torch.device("cpu"))


# --- on a GPU ----------------------------------------------------------------------------------


def _run(engine: GenerationEngine, prompts, gconfigs) -> list[list[int]]:
    rids = [engine.add_request(p, g) for p, g in zip(prompts, gconfigs)]
    done = {}
    while engine.has_unfinished():
        done.update(engine.step())
    return [done[r].output_ids for r in rids]


@pytest.mark.gpu(1)
@pytest.mark.parametrize("kind", list(KINDS))
def test_on_a_gpu_decode_steps_sync_once_and_match_the_cpu(model_tok, prompts, kind):
    """On the GPU in float32: at most one synchronising CUDA call per decode step, by torch's sync
    debug mode (pageable host-to-device copies included); greedy rows give the CPU engine's tokens
    (sampled rows draw from CUDA's own generators: only their lengths are compared)."""
    import copy

    model, tok = model_tok
    gconfigs = _configs(kind, len(prompts))
    engine = GenerationEngine(copy.deepcopy(model).cuda(), tok, seed=3, dtype="float32")
    assert engine.sync_free and engine.dtype == torch.float32
    rids = [engine.add_request(p, g) for p, g in zip(prompts, gconfigs)]
    done = dict(engine.step())
    assert engine._kv.keys[0].device.type == "cuda" and {r.rng.device.type for r in engine._running} == {"cuda"}
    per_step = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while engine.has_unfinished():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                done.update(engine.step())
            per_step.append(len([w for w in caught if "synchroniz" in str(w.message)]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert per_step and max(per_step) <= 1, per_step
    got = [done[r].output_ids for r in rids]
    cpu = _run(GenerationEngine(model, tok, seed=3), prompts, gconfigs)
    assert [len(x) for x in got] == [len(x) for x in cpu]
    assert [x for x, g in zip(got, gconfigs) if g.greedy] == [x for x, g in zip(cpu, gconfigs) if g.greedy]


@pytest.mark.gpu(1)
def test_on_a_gpu_bf16_is_the_whole_model_and_weights_land_in_it(model_tok, prompts):
    """dtype bfloat16 on a GPU: every parameter bf16, log-probs float32 and close to the fp32
    model's; a float32 CPU state dict lands in it (copy_ moves and casts)."""
    import copy

    model, tok = model_tok
    engine = GenerationEngine(copy.deepcopy(model).cuda(), tok, seed=2, dtype="bfloat16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16} and engine._head is None
    gconfig = GenerationConfig(max_new_tokens=16, max_batch_size=8)
    for prompt, res in zip(prompts, engine.generate(prompts, gconfig)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + res.output_ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]
        # a sanity bound (the whole model in bf16, this tiny model's sharp logits): the GPU check
        # measures SmolLM2's figure
        assert (torch.tensor(res.output_logprobs) - expected).abs().median() < 0.1
    state = {n: t.detach().clone() * 0.5 for n, t in model.state_dict().items()}
    engine.load_weights(state)
    for n, t in engine.model.state_dict().items():
        assert t.device.type == "cuda" and t.dtype == torch.bfloat16
        torch.testing.assert_close(t.float().cpu(), state[n].to(torch.bfloat16).float())
