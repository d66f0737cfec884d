"""Float32 CPU linears through oneDNN (realcore/backends/onednn_linear.py): the same outputs and
gradients as torch's own F.linear (up to summation order), and F.linear itself where oneDNN would
compute something else (autocast)."""

import copy

import pytest
import torch

from conftest import skip_unless_ci

from realcore.backends import onednn_linear

# oneDNN runs on every CPU torch supports (it has generic kernels): a torch without it is a build
# or install problem, not this CPU's, so under CI (the pinned torch wheel has it) that fails.
if not onednn_linear.available():
    skip_unless_ci("no oneDNN in this torch build")
torch.set_num_threads(1)


def _mlp(bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40, bias=bias), torch.nn.SiLU(), torch.nn.Linear(40, 16, bias=bias))


@pytest.mark.parametrize("bias", [True, False])
def test_outputs_and_every_gradient_match_torch_linear(bias):
    ref = _mlp(bias)
    ours = copy.deepcopy(ref)
    assert onednn_linear.use_onednn(ours) == 2
    x = torch.randn(3, 7, 24)  # (batch, tokens, features): the leading dims are flattened and restored
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_ours = ref(x_ref), ours(x_ours)
    torch.testing.assert_close(y_ours, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y_ours.backward(g)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, p_ref), p_ours in zip(ref.named_parameters(), ours.parameters()):
        assert p_ours.grad is not None, name
        torch.testing.assert_close(p_ours.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=name)
    # It really ran through oneDNN's autograd function (bit-identical results do not tell here).
    assert type(y_ours.grad_fn).__name__ == "_LinearBackward" and type(y_ref.grad_fn).__name__ != "_LinearBackward"


def test_a_frozen_weight_gets_no_gradient_and_the_input_does():
    layer = torch.nn.Linear(8, 5)
    layer.requires_grad_(False)
    onednn_linear.use_onednn(layer)
    x = torch.randn(4, 8, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and x.grad is not None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, 8))


def test_an_empty_input_gets_empty_output_and_gradients():
    layer = torch.nn.Linear(8, 5)
    onednn_linear.use_onednn(layer)
    x = torch.randn(0, 8, requires_grad=True)
    y = layer(x)
    y.sum().backward()  # oneDNN itself refuses zero-row gradient GEMMs: F.linear takes them
    assert y.shape == (0, 5) and x.grad.shape == (0, 8) and torch.equal(layer.weight.grad, torch.zeros(5, 8))


def test_autocast_and_non_float32_inputs_take_torch_linear():
    layer = torch.nn.Linear(8, 5)
    onednn_linear.use_onednn(layer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(2, 8)).dtype == torch.bfloat16  # autocast's bf16, as without oneDNN
    layer16 = torch.nn.Linear(8, 5).to(torch.bfloat16)
    assert onednn_linear.use_onednn(layer16) == 0  # not float32: left alone


def test_state_dict_and_names_are_unchanged():
    ref = _mlp(True)
    ours = copy.deepcopy(ref)
    onednn_linear.use_onednn(ours)
    assert list(ours.state_dict()) == list(ref.state_dict())
    with torch.no_grad():
        ours[0].weight.mul_(2)  # an in-place weight update reaches the oneDNN path
    torch.testing.assert_close(ours[0](torch.ones(1, 24)), torch.nn.functional.linear(torch.ones(1, 24), ours[0].weight, ours[0].bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_weight_multiplies_like_f_linear_and_follows_the_weight(dtype):
    """The packed copy gives F.linear's product at every batch size (decode, prefill, empty), and
    is rebuilt after an in-place update and after the parameter is replaced."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=False)
    mm = onednn_linear.PackedWeight(layer, dtype)

    def check():
        for rows in (1, 5, 32, 200, 0):
            x = torch.randn(2, rows, 64).to(dtype)
            want = torch.nn.functional.linear(x, layer.weight.detach().to(dtype))
            got = mm(x)
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)

    check()
    assert mm.packed and mm.copy.is_mkldnn
    with torch.no_grad():
        layer.weight.mul_(-3.0)  # an update in place (a load_weights copy_)
    check()
    layer.weight = torch.nn.Parameter(torch.randn(96, 64))  # another tensor
    check()
    layer.mm = mm  # as a module holds it: a copy of the module (packed tensors have no storage) packs anew
    twin = copy.deepcopy(layer)
    x = torch.randn(3, 64).to(dtype)
    assert twin.mm.owner is twin and torch.equal(twin.mm(x), mm(x))


_SHAPES_CHILD = """
import torch
from realcore.backends import onednn_linear
torch.set_num_threads(1)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
lin = torch.nn.Linear(64, 256)
onednn_linear.use_onednn(lin)
marks = {}
for m in range(1, 301):  # a new token count at every step, as in training
    lin(torch.randn(m, 64, requires_grad=True)).sum().backward()
    if m in (150, 300):
        marks[m] = rss()
print(marks[300] - marks[150])
"""


def _growth_over_new_shapes(env_caps: str | None) -> float:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    if env_caps is not None:
        env.update(ONEDNN_PRIMITIVE_CACHE_CAPACITY=env_caps, LRU_CACHE_CAPACITY=env_caps)
    r = subprocess.run([sys.executable, "-c", _SHAPES_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return float(r.stdout.strip().splitlines()[-1])


def test_new_shapes_do_not_grow_memory_past_the_primitive_caches():
    """oneDNN caches a primitive per GEMM shape (two caches, 1024 each by default, ~1 MB per shape
    with its gradients here): bounded by onednn_linear, 150 more token counts after the caches are
    full cost nothing; with the default sizes (the user's values win) they cost hundreds of MB."""
    assert _growth_over_new_shapes(None) < 20
    assert _growth_over_new_shapes("1024") > 100
