"""Real megatron-core on CPU over gloo: TP=2 and PP=2 (1F1B) GPTModels match a TP=1 reference.

Pattern (docs/megatron-cpu.md): one process builds a TP=1 reference with a fixed seed and
saves weights, logits, loss and grads (safetensors, no pickle); then 2 processes slice the
same weights into their TP shards / PP stages and must reproduce logits, loss and gradients.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conftest import import_unless_ci  # noqa: E402

import_unless_ci("megatron.core", "pip install -e '.[megatron]'")
from safetensors.torch import load_file, save_file  # noqa: E402

from realcore.backends.megatron.cpu_compat import apply_cpu_compat  # noqa: E402

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility test"),
    pytest.mark.timeout(120),
]

BATCH, SEQ, VOCAB = 2, 16, 128
RTOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world_size: int, port: int, tp: int, pp: int = 1):
    """Per-process setup: compat layer, gloo group, Megatron parallel state, RNG tracker."""
    torch.set_num_threads(1)
    apply_cpu_compat()
    from megatron.core import parallel_state, tensor_parallel

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _build_gpt(pp: int = 1):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        bf16=False,
        fp16=False,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    )


def _batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    # [1, 1, s, s], True = masked (future positions)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tokens[:, :-1], position_ids, mask, tokens[:, 1:]


def _forward_backward(model):
    """Returns (logits [b, s, V], mean token loss, {param name: grad})."""
    input_ids, position_ids, mask, labels = _batch()
    # runtime_gather_output: all-gather the vocab-parallel logits to the full [b, s, V]
    logits = model(input_ids, position_ids, mask, runtime_gather_output=True)
    loss = model(input_ids, position_ids, mask, labels=labels).mean()  # per-token loss [b, s]
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def _shard(full: torch.Tensor, local_shape, rank: int, world: int) -> torch.Tensor:
    """Slice a full (TP=1) tensor into this rank's shard: the one dim whose size differs."""
    if tuple(full.shape) == tuple(local_shape):
        return full
    dims = [d for d, (f, s) in enumerate(zip(full.shape, local_shape)) if f != s]
    assert len(dims) == 1 and full.shape[dims[0]] == local_shape[dims[0]] * world, (
        full.shape,
        local_shape,
    )
    return full.chunk(world, dim=dims[0])[rank]


def _check_compat_idempotent():
    current_device = torch.cuda.current_device
    assert apply_cpu_compat() is True
    assert apply_cpu_compat() is True
    assert torch.cuda.current_device is current_device  # repeated calls patched nothing again
    assert torch.cuda.current_device() == torch.device("cpu")


def _reference_worker(rank, port, out_dir):
    _init(rank, 1, port, tp=1)
    _check_compat_idempotent()  # here rather than in pytest's process: patches must not leak
    torch.manual_seed(0)
    model = _build_gpt()
    weights = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(weights, f"{out_dir}/weights.st")
    logits, loss, grads = _forward_backward(model)
    save_file({"logits": logits, "loss": loss, **{"grad." + k: v for k, v in grads.items()}},
              f"{out_dir}/ref.st")
    torch.distributed.destroy_process_group()


def _tp_worker(rank, world, port, out_dir):
    _init(rank, world, port, tp=world)
    model = _build_gpt()
    full = load_file(f"{out_dir}/weights.st")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_shard(full[name], param.shape, rank, world))
    logits, loss, grads = _forward_backward(model)
    ref = load_file(f"{out_dir}/ref.st")
    _assert_close(logits, ref["logits"], "logits")
    _assert_close(loss, ref["loss"], "loss")
    for name, grad in grads.items():
        _assert_close(grad, _shard(ref["grad." + name], grad.shape, rank, world), name)
    torch.distributed.destroy_process_group()


def _assert_close(actual, expected, what):
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-12)
    assert err < RTOL, f"{what}: relative error {err:.2e}"


def _spawn(fn, nprocs, *args):
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(fn, args=args, nprocs=nprocs, join=True)


def _pp_worker(rank, world, port, out_dir):
    """PP=2, 1F1B over 2 microbatches of 1 sequence: loss and grads equal the reference."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from realcore.backends.megatron.cpu_compat import cuda_to_cpu_mode

    _init(rank, world, port, tp=1, pp=world)
    model = _build_gpt(pp=world)
    layer_offset = rank * (2 // world)  # this stage holds global layers [offset, offset + 1)
    full = load_file(f"{out_dir}/weights.st")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(full[_global_name(name, layer_offset)])

    input_ids, position_ids, mask, labels = _batch()
    microbatches = iter([(input_ids[i : i + 1], position_ids[i : i + 1], labels[i : i + 1])
                         for i in range(BATCH)])

    def forward_step(data_iterator, model):
        ids, pos, lab = next(data_iterator)
        per_token_loss = model(ids, pos, mask, labels=lab)  # [1, s] on the last stage

        def loss_func(output):
            loss = output.mean()
            # schedules divide the returned loss in place: report a detached copy
            return loss, {"loss": loss.detach().clone()}

        return per_token_loss, loss_func

    with cuda_to_cpu_mode():
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=microbatches, model=[model],
            num_microbatches=BATCH, seq_length=SEQ, micro_batch_size=1, forward_only=False,
        )
    ref = load_file(f"{out_dir}/ref.st")
    if rank == world - 1:
        loss = torch.stack([d["loss"] for d in losses]).mean()  # equal-size microbatches
        _assert_close(loss, ref["loss"], "pp loss")
    for name, param in model.named_parameters():
        _assert_close(param.grad, ref["grad." + _global_name(name, layer_offset)], name)
    torch.distributed.destroy_process_group()


def _global_name(local_name: str, layer_offset: int) -> str:
    """decoder.layers.<local i>.x -> decoder.layers.<i + offset>.x (Megatron names are local)."""
    parts = local_name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """TP=1 single-process reference: weights.st and ref.st (logits, loss, grads)."""
    out_dir = str(tmp_path_factory.mktemp("megatron_ref"))
    _spawn(_reference_worker, 1, _free_port(), out_dir)
    return out_dir


def test_apply_cpu_compat_idempotent(reference_dir):
    # Checked by _check_compat_idempotent inside the reference process (spawning costs ~6 s).
    assert os.path.exists(f"{reference_dir}/ref.st")


def test_gpt_tp2_matches_tp1(reference_dir):
    _spawn(_tp_worker, 2, 2, _free_port(), reference_dir)


def test_gpt_pp2_1f1b_matches_tp1(reference_dir):
    _spawn(_pp_worker, 2, 2, _free_port(), reference_dir)


PACKED_LENS = [5, 7, 4]  # one packed row of three sequences, SEQ tokens in all


def _packed_worker(rank, world, port):
    """realcore's core attention takes Megatron's THD packing (no mask): the packed row's logits and
    gradients equal those of each sequence run alone with a causal mask (positions from 0)."""
    _init(rank, world, port, tp=world)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from realcore.backends.megatron.varlen_attention import VarlenDotProductAttention, packed_seq_params

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = VarlenDotProductAttention
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    masks = []
    for m in model.modules():
        if isinstance(m, VarlenDotProductAttention):
            m.register_forward_pre_hook(lambda _m, args, kw: masks.append((args[3], kw["packed_seq_params"])),
                                        with_kwargs=True)
    tokens = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(3))
    assert sum(PACKED_LENS) == SEQ
    from realcore.backends.megatron import varlen_attention as mva

    longest, attend = [], mva.packed_causal_attention
    def spy(*args, max_len=None, **kwargs):
        longest.append(max_len)
        return attend(*args, max_len=max_len, **kwargs)

    mva.packed_causal_attention = spy

    packed = model(tokens[None], None, None, packed_seq_params=packed_seq_params(PACKED_LENS, PACKED_LENS, "cpu"),
                   runtime_gather_output=True)[0]
    assert masks and all(mask is None and p.qkv_format == "thd" for mask, p in masks)
    # The fused kernels' longest sequence comes from the params, a host int: no host sync per layer.
    assert longest == [max(PACKED_LENS)] * 2 and all(type(n) is int for n in longest)
    (packed.float().square().mean()).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alone, start = [], 0
    for n in PACKED_LENS:
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)[None, None]
        alone.append(model(tokens[start:start + n][None], torch.arange(n)[None], causal,
                           runtime_gather_output=True)[0])
        start += n
    alone = torch.cat(alone)
    (alone.float().square().mean()).backward()
    _assert_close(packed.detach(), alone.detach(), "packed logits")
    for name, p in model.named_parameters():
        _assert_close(packed_grads[name], p.grad, f"packed grad {name}")
    torch.distributed.destroy_process_group()


def test_packed_thd_attention_matches_sequences_alone():
    """TP=2 with grouped-query attention (one KV group per rank)."""
    _spawn(_packed_worker, 2, 2, _free_port())


COMPAT_ONLY = """
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from realcore.backends.megatron.compat import apply_compat

current_device = torch.cuda.current_device
apply_compat()
apply_compat()
assert torch.cuda.current_device is current_device  # nothing of the CPU layer
assert moe_utils.te_general_gemm is None  # defined: the router's matmul runs without TransformerEngine
config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                           sequence_parallel=True, normalization="RMSNorm", use_cpu_initialization=True)
norm = WrappedTorchNorm(config, 8, eps=1e-6)
assert isinstance(norm, torch.nn.RMSNorm) and all(p.sequence_parallel for p in norm.parameters())
print("ok")
"""


def test_the_compat_layer_for_every_device_stands_alone():
    """compat.py (applied on GPUs too): MoE routing without TransformerEngine and sequence parallel
    with torch's RMSNorm, and none of the CPU layer's patches (a fresh process)."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", COMPAT_ONLY], cwd=repo, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": repo})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
