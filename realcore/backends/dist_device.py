"""Where this process computes, and where a collective's tensors must live.

A process selects its GPU once, before any process group (realcore.backends.device.select_device);
engines then compute on the current CUDA device (`compute_device`), so a test or a launcher that
calls `torch.cuda.set_device(rank)` places them too. A collective takes tensors on the device of its
group's backend (`group_device`): NCCL only moves CUDA tensors, gloo CPU ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
