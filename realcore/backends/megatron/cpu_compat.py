"""CPU compatibility layer for megatron-core 0.16.1 (docs/megatron-cpu.md says what and why).

Megatron assumes CUDA everywhere (`torch.cuda.current_device()`, CUDA RNG state, streams,
`device="cuda"` literals, `param.type() == "torch.cuda.FloatTensor"`). On a machine without
CUDA, `apply_cpu_compat()` patches those spots so the real Megatron code (TP, SP, PP, EP, DDP,
optimizers) runs over gloo with the same numerics as a single-process reference.

Everything here is a no-op when `torch.cuda.is_available()` is True: GPU runs are never touched.
The two Megatron fixes that are not about the CPU (MoE routing without TransformerEngine, sequence
parallel with torch's norm) live in compat.py, applied on GPUs too; this layer applies them as well.

Usage:
    apply_cpu_compat()                 # before building Megatron models
    with cuda_to_cpu_mode():           # around schedules / DDP / optimizer construction
        losses = forward_backward_func(...)
"""

import contextlib
import types

import torch
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from torch.overrides import TorchFunctionMode

from realcore.backends.megatron.compat import apply_compat

_applied = False


def apply_cpu_compat() -> bool:
    """Patch torch.cuda and megatron-core for CPU; returns True if the patches are (now) active.

    Idempotent. Does nothing and returns False when CUDA is available.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    _shim_cuda_device()
    _shim_cuda_streams()
    _shim_cuda_rng()
    _shim_cuda_moves()
    _patch_megatron_rng()
    _patch_megatron_moe()
    apply_compat()
    _applied = True
    return True


# ---- torch.cuda shims -------------------------------------------------------------------------


def _shim_cuda_device():
    # Megatron allocates buffers with device=torch.cuda.current_device(): make that the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.set_device = lambda device: None


def _shim_cuda_streams():
    # Streams/events/synchronize only order GPU work; on CPU everything is already ordered.
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.default_stream = lambda device=None: _NullStream()
    torch.cuda.nvtx = types.SimpleNamespace(
        range_push=lambda *a, **k: None,
        range_pop=lambda *a, **k: None,
        range=lambda *a, **k: contextlib.nullcontext(),
        mark=lambda *a, **k: None,
    )


class _NullStream:
    """Stand-in for torch.cuda.Stream: every operation is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    """Stand-in for torch.cuda.Event: every operation is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _shim_cuda_rng():
    # Megatron seeds/forks the "CUDA" RNG for dropout and init: route it to the CPU generator.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly.)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    torch.cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(seed)


def _shim_cuda_moves():
    # `.cuda()` calls are scattered through Megatron; on CPU they must leave tensors in place.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self


# ---- megatron-core patches --------------------------------------------------------------------


def _patch_megatron_rng():
    # The RNG tracker reads CUDA default generators directly; use the CPU generator instead.
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )


def _patch_megatron_moe():
    # The alltoall dispatcher expects numpy split sizes, but only converts CUDA tensors.
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.detach().cpu().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# ---- device="cuda" rewriting ------------------------------------------------------------------


def cuda_to_cpu_mode():
    """Context manager: rewrite `device="cuda"` kwargs to cpu and report CPU tensors as cuda.

    Needed around Megatron schedules, DDP and optimizers, which allocate with `device="cuda"`
    literals and check `param.type() == "torch.cuda.FloatTensor"`. A null context on CUDA.
    """
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _CudaToCpuMode()


class _CudaToCpuMode(TorchFunctionMode):
    """TorchFunctionMode that maps every "cuda" device argument to "cpu"."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.type:
            return _tensor_type(func, args, kwargs)
        if func is torch.Tensor.to:
            args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _tensor_type(func, args, kwargs):
    # With no dtype: Megatron compares against "torch.cuda.*Tensor" names. With one: drop "cuda".
    dtype = args[1] if len(args) > 1 else kwargs.pop("dtype", None)
    if dtype is None:
        return func(args[0]).replace("torch.", "torch.cuda.", 1)
    if isinstance(dtype, str):
        dtype = dtype.replace("torch.cuda.", "torch.", 1)
    return func(args[0], dtype, **kwargs)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")
