"""Context parallel (CP=2) on GPUs: log-probs, gradients and a 5-step trajectory match the
single-process reference, like the CPU meshes in test_megatron_engine.py.

Megatron runs context parallel attention only through TransformerEngine, so this needs 2 GPUs
and `transformer_engine`; on CPU machines (CI here) it is skipped and the launcher refuses c>1.
"""

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallel needs 2 GPUs with TransformerEngine"),
    pytest.mark.timeout(600),
]


def test_cp2_matches_reference(tmp_path):
    pytest.importorskip("transformer_engine")
    import torch.multiprocessing as mp

    from tests.test_megatron_engine import _free_port, _reference_dir, _worker

    hf_path, out = _reference_dir(str(tmp_path), "untied")
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_worker, args=(2, _free_port(), hf_path, out, "d1p1t1c2", {}), nprocs=2, join=True)
