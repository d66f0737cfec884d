"""Context parallel (CP=2) on GPUs: log-probs, a 5-step trajectory and the saved checkpoint follow
the single-process float32 reference within bf16's tolerance (test_megatron_bf16.py's checks).

Megatron runs context parallel attention only through TransformerEngine, whose CP attention needs
its fused or flash backends (bf16; float32 has only the unfused one, without CP): so this runs in
bf16, needs 2 GPUs and `transformer_engine`; on CPU machines (CI here) it is skipped and the
launcher refuses c>1.
"""

import os

import pytest
import torch

from conftest import import_unless_ci  # noqa: E402

import_unless_ci("megatron.core", "pip install -e '.[megatron]'")
pytestmark = [
    pytest.mark.gpu(2),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (context parallel, one rank per GPU, "
                       "with TransformerEngine)"),
    pytest.mark.timeout(600),
]


def test_cp2_matches_reference(tmp_path):
    pytest.importorskip("transformer_engine")
    import torch.multiprocessing as mp

    from tests.test_megatron_bf16 import _worker
    from tests.test_megatron_engine import _free_port, _reference_dir

    hf_path, out = _reference_dir(str(tmp_path), "untied")
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_worker, args=(2, _free_port(), hf_path, out, "d1p1t1c2"), nprocs=2, join=True)
