"""Float32 linear layers on a CPU through oneDNN, forward and backward.

torch multiplies float32 on a CPU with its default BLAS (MKL). On an AMD EPYC with AVX-512
(2026-11-27) MKL ran at about half oneDNN's speed for every GEMM of a linear layer, at decode sizes
(batch 32) and at training sizes (1024 tokens: forward 18.7 vs 7.8 ms, input gradient 17.3 vs 8.5,
weight gradient 17.2 vs 9.3 for 576 -> 1536); vLLM's CPU backend uses oneDNN for this reason. On an
Intel CPU the two ran level. oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, what inductor
calls on a CPU) has no autograd formula: `_Linear` gives it one, with the two gradient GEMMs
through oneDNN as well.

`use_onednn(model)` switches every float32 CPU `nn.Linear` of `model` by setting its `forward`
(an instance attribute: the module, its parameters and their names stay, so state dicts, weight
updates by name, tied embeddings and PEFT's wrapping work as before). Each call still takes
torch's own `F.linear` when oneDNN would not compute the same thing: under autocast (bf16 compute
is asked for), for a tensor that is not a float32 CPU tensor, or an empty input (oneDNN refuses
the gradient GEMMs of zero rows).

`PackedWeight` is for inference (a generation server's bf16 linears): a copy of a weight in
oneDNN's blocked layout, so that oneDNN does not reorder the weight at every call; rebuilt when
the weight changes in place.
"""

from __future__ import annotations

import functools
import os

# oneDNN keeps a primitive per GEMM shape, in two caches of 1024 entries each by default (oneDNN's
# own and ideep's): training's token counts and decoding's batch sizes make a new shape at almost
# every step, about 1 MB each with its gradient GEMMs here, so a worker grew by hundreds of MB before they
# filled (bench/soak.py). 128 holds a decode step's shapes (the batch size stays for many steps);
# an evicted shape costs its primitive again (milliseconds). Both are read at the first GEMM, so
# set before any: the user's values win.
PRIMITIVE_CACHE_CAPACITY = 128
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, str(PRIMITIVE_CACHE_CAPACITY))

import torch  # noqa: E402  (after the environment above)
import torch.nn.functional as F  # noqa: E402

_OP = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_PACK = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)
# The batch size oneDNN picks the packed layout for: a decode step's. Other sizes (prefill, batch 1)
# measured as fast or faster than with the plain weight, 2026-11-27 (AMD EPYC).
_PACK_BATCH = 32


def available() -> bool:
    return _OP is not None and torch.backends.mkldnn.is_available()


def _mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T through oneDNN: a (M, K), b (N, K) -> (M, N)."""
    return _OP(a, b, None, "none", [], "")


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _OP(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm_t(g, weight.t().contiguous()).view(*x.shape)  # g @ W
        if ctx.needs_input_grad[1]:
            grad_w = _mm_t(g.t().contiguous(), x.reshape(-1, x.shape[-1]).t().contiguous())  # g.T @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def _fits(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


def linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` through oneDNN where it computes what F.linear would, else F.linear."""
    w, b = module.weight, module.bias
    if (torch.is_autocast_enabled("cpu") or not _fits(x) or x.numel() == 0  # oneDNN refuses an empty gradient GEMM
            or not _fits(w) or (b is not None and not _fits(b))
            or type(w) is not torch.nn.Parameter and type(w) is not torch.Tensor):  # a DTensor, a subclass
        return F.linear(x, w, b)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return _Linear.apply(x, w, b)
    return _OP(x, w, b, "none", [], "")


def use_onednn(model: torch.nn.Module) -> int:
    """Route every float32 CPU nn.Linear of `model` through oneDNN; returns how many. Nothing
    changes where oneDNN is unavailable."""
    if not available():
        return 0
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and _fits(m.weight):
            m.forward = functools.partial(linear, m)
            n += 1
    return n


class PackedWeight:
    """x @ owner.weight.T (no bias) for inference, through a copy of the weight in `dtype` and
    oneDNN's blocked layout. The copy is rebuilt whenever the weight changed: in place (its version
    counter: weight updates and LoRA merges copy into it) or replaced by another tensor, so callers
    keep using the parameter as before. Where oneDNN cannot take it (no mkldnn, not a CPU tensor)
    the copy stays plain and `F.linear` multiplies. Measured on a SmolLM2-135M decode step's bf16
    linears at batch 32: 29 -> 24 ms (AMD EPYC, 2026-11-27); batch 1 about 2x."""

    def __init__(self, owner: torch.nn.Module, dtype: torch.dtype):
        self.owner, self.dtype = owner, dtype
        self.source, self.stamp, self.copy, self.packed = None, None, None, False

    # oneDNN's packed tensors have no storage to copy or pickle: a copy packs again on first use.
    def __getstate__(self):
        return {"owner": self.owner, "dtype": self.dtype}

    def __setstate__(self, state):
        self.__init__(state["owner"], state["dtype"])

    def _refresh(self) -> None:
        w = self.owner.weight
        stamp = (w.data_ptr(), w._version)
        if w is self.source and stamp == self.stamp:
            return
        plain = w.detach().to(self.dtype)
        self.packed = available() and _PACK is not None and plain.device.type == "cpu"
        self.copy = _PACK(plain, _PACK_BATCH) if self.packed else plain
        self.source, self.stamp = w, stamp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) in `dtype` -> (..., out_features) in `dtype`."""
        self._refresh()
        if not self.packed:
            return F.linear(x, self.copy)
        if not x.numel():
            return x.new_empty(*x.shape[:-1], self.owner.weight.shape[0])
        return _OP(x, self.copy, None, "none", [], "")
