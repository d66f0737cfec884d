"""MegatronEngine on 1 and 2 GPUs over NCCL, in float32 against the float32 reference of
test_megatron_engine.py (relative error < 1e-4): the meshes whose collectives ran on CPU tensors
before (the PP broadcast of log-probs, the HF gather's send/recv of every checkpoint and gradient,
the expert-parallel micro-batch count, the stats' all-reduce). TF32 stays off for float32 roles,
so GPU and CPU agree to float32 summation order. bf16 on GPUs: test_megatron_bf16.py."""

import os

import pytest

from conftest import import_unless_ci  # noqa: E402

import_unless_ci("megatron.core", "pip install -e '.[megatron]'")

pytestmark = [pytest.mark.timeout(600)]

CASES = [
    ("d1p2t1", "tied", {}),  # PP=2: log-probs broadcast from the last stage, tied embeddings
    ("d2p1t1e2", "qwen2_moe", {"distributed_optimizer": False}),  # EP=2: the micro-batch count over DP
    ("d1p1t2", "untied", {}),  # TP=2 with sequence parallel (torch's RMSNorm, compat.py)
]


@pytest.mark.gpu(1)
def test_float32_on_one_gpu_matches_the_reference(tmp_path):
    """Megatron on one GPU (the mesh d1p1t1 over a one-rank NCCL group): model build with torch's
    RMSNorm, packed attention on the GPU, training, the HF export; what the one-GPU check can run."""
    import torch.multiprocessing as mp

    from tests.test_megatron_engine import _free_port, _reference_dir, _worker

    hf_path, out = _reference_dir(str(tmp_path), "untied")
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_worker, args=(1, _free_port(), hf_path, out, "d1p1t1", {}), nprocs=1, join=True)


@pytest.mark.gpu(2)
@pytest.mark.parametrize("mesh,kind,megatron", CASES, ids=[m for m, _, _ in CASES])
def test_float32_meshes_on_two_gpus_match_the_reference(tmp_path, mesh, kind, megatron):
    import torch.multiprocessing as mp

    from tests.test_megatron_engine import _free_port, _reference_dir, _worker

    hf_path, out = _reference_dir(str(tmp_path), kind)
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_worker, args=(2, _free_port(), hf_path, out, mesh, megatron), nprocs=2, join=True)
