"""Which compute dtype a role may use here: bf16 on GPUs, and on CPUs with bf16 instructions."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX-512 BF16 or AMX); without them bf16 matmuls are emulated."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_bf16(dtype: str) -> None:
    """ValueError (one line) for dtype=bfloat16 where it cannot run well: a CPU without bf16 instructions."""
    if dtype == "bfloat16" and not torch.cuda.is_available() and not cpu_has_bf16():
        raise ValueError("dtype=bfloat16: this CPU has no bf16 instructions (avx512_bf16 or amx_bf16); use float32")
