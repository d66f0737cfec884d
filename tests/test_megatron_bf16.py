"""MegatronEngine with role.dtype=bfloat16: megatron-core's mixed precision (bf16 parameters and
activations, fp32 main gradients, fp32 master weights and Adam state), against the fp32 reference
of test_megatron_engine.py. On CPU it runs where the CPU has bf16 instructions (else skipped with
the reason); the same code runs on a GPU, where the GPU test below runs as it is."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from conftest import import_unless_ci  # noqa: E402

import_unless_ci("megatron.core", "pip install -e '.[megatron]'")
from safetensors.torch import load_file  # noqa: E402
from test_megatron_engine import STEPS, _data, _free_port, _loss_fn, _n_tokens, _reference_dir, init_dist  # noqa: E402

from realcore.backends.precision import cpu_has_bf16  # noqa: E402

pytestmark = pytest.mark.timeout(300)
# bf16 keeps 8 bits of mantissa: log-probs and losses agree with fp32 to about 1e-2, not 1e-4.
RTOL = 3e-2


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _role():
    from realcore.api.config import OptimizerConfig, RoleConfig

    return RoleConfig(backend="megatron", trainable=True, max_tokens_per_mb=24, dtype="bfloat16",
                      optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1, max_grad_norm=1.0))


def _worker(rank, world, port, hf_path, out, mesh):
    torch.set_num_threads(1)
    from realcore.api.alloc import parse_mesh
    from realcore.backends.megatron.engine import MegatronEngine

    init_dist(rank, world, port)  # NCCL, each rank on its own GPU, where there are GPUs
    dims = parse_mesh(mesh)
    engine = MegatronEngine(hf_path, _role(), dims, total_steps=STEPS)
    params = [p for c in engine.chunks for p in c.parameters()]
    assert {p.dtype for p in params} == {torch.bfloat16}, [n for c in engine.chunks for n, p in c.named_parameters() if p.dtype != torch.bfloat16]
    assert {p.main_grad.dtype for p in params} == {torch.float32}  # gradients reduced and kept in fp32
    masters = [p for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
               for g in opt.optimizer.param_groups for p in g["params"]]
    assert masters and {p.dtype for p in masters} == {torch.float32}  # Adam steps fp32 master weights
    ref = load_file(f"{out}/ref.st")
    data = _data()
    lps = engine.logprobs(data["input_ids"])
    assert {lp.dtype for lp in lps} == {torch.float32}
    for i, lp in enumerate(lps):
        assert _rel(lp, ref[f"lp.{i}"]) < RTOL, f"logprobs[{i}]: {_rel(lp, ref[f'lp.{i}']):.2e}"
    d = dims.dp_rank(rank)
    shard = {k: v[d::dims.dp] for k, v in data.items()}
    with open(f"{out}/ref.json") as f:
        expected = json.load(f)
    losses = [engine.train_batch(shard, _loss_fn, _n_tokens)["loss"] for _ in range(STEPS)]
    for step, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= RTOL * abs(b) + 1e-3, f"step {step}: bf16 loss {a} vs fp32 {b} ({losses} vs {expected})"
    saved = f"{out}/saved-bf16-{mesh}"
    engine.save_hf(saved)
    torch.distributed.barrier()
    if rank == 0:
        from realcore.api.config import RoleConfig
        from realcore.backends.torch_engine import TorchEngine

        reloaded = TorchEngine(saved, RoleConfig(backend="torch", dtype="float32"), total_steps=1)
        for a, b in zip(reloaded.logprobs(data["input_ids"]), engine.logprobs(data["input_ids"])):
            assert _rel(a, b) < RTOL
    else:
        engine.logprobs(data["input_ids"])  # collective
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("megatron_bf16"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU route (the GPU test is below)")
@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bf16 instructions (avx512_bf16 or amx_bf16)")
@pytest.mark.parametrize("mesh", ["d1p1t2", "d2p1t1"])
def test_bf16_training_follows_fp32(root, mesh):
    from realcore.api.alloc import parse_mesh

    hf_path, out = _reference_dir(root, "untied")
    os.environ["OMP_NUM_THREADS"] = "1"
    world = parse_mesh(mesh).world_size
    mp.spawn(_worker, args=(world, _free_port(), hf_path, out, mesh), nprocs=world, join=True)


@pytest.mark.gpu(2)
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs (NCCL, one rank per GPU); the CPU test above runs the same code over gloo")
@pytest.mark.parametrize("mesh", ["d1p1t2", "d2p1t1"])
def test_bf16_training_follows_fp32_on_gpus(root, mesh):
    """TP=2 (sequence parallel, torch's RMSNorm) and DP=2 on cuda:0 and cuda:1 over NCCL: log-probs
    through the fused varlen kernel, stats and the HF gather on the GPUs' collectives."""
    hf_path, out = _reference_dir(root, "untied")
    mp.spawn(_worker, args=(2, _free_port(), hf_path, out, mesh), nprocs=2, join=True)
