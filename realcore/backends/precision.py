"""The compute dtype of a model role (RoleConfig.dtype), and whether this machine can run it.

"auto" (the default) is bfloat16 on a GPU and float32 on a CPU.

bf16 on a CPU without bf16 instructions is converted to float32 and back around every op: slower
than float32 and no more exact than bf16, so it is refused rather than run.
"""

from __future__ import annotations

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags in /proc/cpuinfo of native bf16 matmuls


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU lists one of BF16_CPU_FLAGS (False where /proc/cpuinfo is unreadable)."""
    try:
        with open(cpuinfo) as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return False
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def bf16_unsupported(device_type: str, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """Why bfloat16 cannot run on `device_type` here, in one line; None when it can."""
    if device_type == "cuda":
        return None if torch.cuda.is_bf16_supported() else "dtype=bfloat16: this GPU has no bf16 support (use float32)"
    if device_type == "cpu" and not cpu_has_bf16(cpuinfo):
        return (f"dtype=bfloat16: this CPU has no bf16 instructions ({' or '.join(BF16_CPU_FLAGS)} in {cpuinfo}); "
                "use dtype=float32")
    return None


def resolve_dtype_name(name: str, device: torch.device | str) -> str:
    """"auto" -> "bfloat16" on a GPU that has it (float32 on older GPUs, e.g. a V100), "float32" on a
    CPU (bf16 there is an opt-in speed mode with a log-prob cost); other names as given. A launcher
    that sees no GPU itself (it plans for the node's) takes a GPU to have bf16."""
    if name != "auto":
        return name
    if torch.device(device).type != "cuda":
        return "float32"
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "float32"
    return "bfloat16"


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """RoleConfig.dtype ("auto" resolved for `device`) as a torch dtype; ValueError when the device
    cannot compute in it."""
    name = resolve_dtype_name(name, device)
    if name == "float32":
        return torch.float32
    if name != "bfloat16":
        raise ValueError(f"dtype: {name!r} is not float32 or bfloat16")
    why = bf16_unsupported(device.type)
    if why is not None:
        raise ValueError(why)
    return torch.bfloat16
