"""Which device a process computes on.

The launcher places every process on GPUs of its own by setting its CUDA_VISIBLE_DEVICES
(realcore/launch/placement.py); Slurm (`--gpus-per-task`) and Ray (`num_gpus`) do the same. So a
process uses the first device it sees, `cuda:0`, unless LOCAL_RANK (torchrun's convention) names
another one, and the CPU when it sees none. A process selects its device before it creates a
process group or a CUDA tensor (`select_device`), so that NCCL and every `torch.cuda` call that
takes the current device agree with it.

Engines then compute on the current device (`compute_device`: a test or a launcher that calls
`torch.cuda.set_device(rank)` places them too), and a collective takes tensors on the device of its
group's backend (`group_device`): NCCL only moves CUDA tensors, gloo CPU ones.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


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


def compute_device() -> torch.device:
    """This process's current CUDA device when it sees a GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_device(group=None) -> torch.device:
    """The device of the tensors a collective over `group` (None: the default group) moves: this
    process's GPU for an NCCL group, the CPU otherwise (gloo)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (on the CPU) on `device`. To a GPU through pinned memory without blocking: a copy from
    pageable memory may wait for the device's queue, a host sync per micro-batch."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
