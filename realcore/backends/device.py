"""Which device a process computes on.

The launcher places every process on GPUs of its own by setting its CUDA_VISIBLE_DEVICES
(realcore/launch/placement.py); Slurm (`--gpus-per-task`) and Ray (`num_gpus`) do the same. So a
process uses the first device it sees, `cuda:0`, unless LOCAL_RANK (torchrun's convention) names
another one, and the CPU when it sees none. A process selects its device before it creates a
process group or a CUDA tensor (`select_device`), so that NCCL and every `torch.cuda` call that
takes the current device agree with it.
"""

from __future__ import annotations

import os

import torch


def local_gpu_index() -> int:
    """The visible GPU this process uses: LOCAL_RANK when several are visible and it is set, else 0."""
    n = torch.cuda.device_count()
    rank = os.environ.get("LOCAL_RANK")
    if n > 1 and rank is not None and rank.isdigit():
        return int(rank) % n
    return 0


def process_device(name: str = "auto") -> torch.device:
    """"auto": this process's GPU when it sees one, else the CPU; "cuda": its GPU, ValueError (one
    line) where there is none; "cpu": the CPU."""
    if name == "cpu":
        return torch.device("cpu")
    if name not in ("auto", "cuda"):
        raise ValueError(f"device: {name!r} is not auto, cpu or cuda")
    if torch.cuda.is_available():
        return torch.device("cuda", local_gpu_index())
    if name == "cuda":
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f" (CUDA_VISIBLE_DEVICES={seen!r})" if seen is not None else ""
        raise ValueError(f"device cuda: this process sees no CUDA GPU{why}; use cpu (or auto)")
    return torch.device("cpu")


def select_device(name: str = "auto") -> torch.device:
    """process_device(name), made the current CUDA device when it is a GPU (before any process group)."""
    device = process_device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
