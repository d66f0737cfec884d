"""MegatronEngine.save_state / load_state: a restarted role continues exactly.

For each mesh: train 2 steps, save_state, train 2 more (losses, final HF weights); then in fresh
processes build the engine from the same HF model, load_state and train the same 2 steps: the
losses and every final tensor must equal the uninterrupted run's (max abs diff <= 1e-6), and the
version and RNG state must be the saved ones. A checkpoint of another mesh is refused.
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from conftest import import_unless_ci  # noqa: E402

import_unless_ci("megatron.core", "pip install -e '.[megatron]'")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_megatron_engine import _data as batch_of  # noqa: E402
from test_megatron_engine import _free_port, _loss_fn, _n_tokens  # noqa: E402

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility test"), pytest.mark.timeout(300)]

ATOL = 1e-6
SAVE_AT, STEPS = 2, 4  # steps before the save, steps in all (the LR schedule spans all of them)


def _hf_dir(root: str, kind: str) -> str:
    """A small random HF model: Qwen2 with untied or tied embeddings, or Qwen2-MoE (4 experts)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    path = os.path.join(root, f"hf-{kind}")
    if os.path.exists(path):
        return path
    torch.manual_seed(0)
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=128,
                  rms_norm_eps=1e-6, max_position_embeddings=128, intermediate_size=96)
    if kind == "moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, moe_intermediate_size=32, num_experts=4,
                                                   shared_expert_intermediate_size=48, num_experts_per_tok=2,
                                                   tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=kind == "tied"))
    model.save_pretrained(path)
    return path


def _data(step: int):
    """A different batch per step, so a restart that replays the wrong step shows."""
    return batch_of(100 + step)


def _engine(hf_path: str, mesh: str, megatron: dict):
    from realcore.api.alloc import parse_mesh
    from realcore.api.config import OptimizerConfig, RoleConfig
    from realcore.backends.megatron.engine import MegatronEngine

    role = RoleConfig(backend="megatron", trainable=True, max_tokens_per_mb=24, megatron=megatron,
                      optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=1, max_grad_norm=1.0))
    return MegatronEngine(hf_path, role, parse_mesh(mesh), total_steps=STEPS)


def _train(engine, steps: range) -> list[float]:
    dp, d = engine.dims.dp, engine.replica
    return [engine.train_batch({k: v[d::dp] for k, v in _data(s).items()}, _loss_fn, _n_tokens)["loss"]
            for s in steps]


def _rng() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    out = {"cpu": torch.get_rng_state()}
    out.update({f"tracker.{k}": v for k, v in get_cuda_rng_tracker().get_states().items()})
    return out


def _draw_random():
    """Advance the CPU generator and the TP tracker (as dropout would), so a restart that does not
    restore them shows."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.rand(3)
    with get_cuda_rng_tracker().fork():
        torch.rand(3)


def _init(rank: int, world: int, port: int):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _run_and_save(rank, world, port, hf_path, out, mesh, megatron):
    """The uninterrupted run: train, save the recover state midway, train on."""
    _init(rank, world, port)
    engine = _engine(hf_path, mesh, megatron)
    _train(engine, range(SAVE_AT))
    _draw_random()
    engine.save_state(f"{out}/ckpt")
    save_file(_rng(), f"{out}/rng-{rank}.st")
    losses = _train(engine, range(SAVE_AT, STEPS))
    final = engine.hf_state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in final.items()}, f"{out}/final.st")
        with open(f"{out}/losses.json", "w") as f:
            json.dump(losses, f)
    torch.distributed.destroy_process_group()


def _restart(rank, world, port, hf_path, out, mesh, megatron):
    """Fresh processes: load the recover state and train the same steps."""
    _init(rank, world, port)
    engine = _engine(hf_path, mesh, megatron)
    engine.load_state(f"{out}/ckpt")
    assert engine.version == SAVE_AT
    saved_rng = load_file(f"{out}/rng-{rank}.st")
    for k, v in _rng().items():
        assert torch.equal(v, saved_rng[k]), f"RNG state {k} not restored"
    losses = _train(engine, range(SAVE_AT, STEPS))
    final = engine.hf_state_dict()
    if rank == 0:
        with open(f"{out}/losses.json") as f:
            expected = json.load(f)
        assert max(abs(a - b) for a, b in zip(losses, expected)) <= ATOL, f"losses {losses} vs {expected}"
        reference = load_file(f"{out}/final.st")
        assert final.keys() == reference.keys()
        for k, v in final.items():
            diff = (v - reference[k]).abs().max().item()
            assert diff <= ATOL, f"{k}: max abs diff {diff:.2e}"
    torch.distributed.destroy_process_group()


def _load_elsewhere(rank, world, port, hf_path, ckpt, mesh):
    """A checkpoint of another mesh: one ValueError naming both meshes, on every rank."""
    _init(rank, world, port)
    engine = _engine(hf_path, mesh, {})
    with pytest.raises(ValueError, match=r"mesh dp=2 pp=1 tp=1 .* this role runs on dp=1 pp=1 tp=2"):
        engine.load_state(ckpt)
    torch.distributed.destroy_process_group()


def _spawn(fn, mesh: str, *args):
    from realcore.api.alloc import parse_mesh

    os.environ["OMP_NUM_THREADS"] = "1"
    world = parse_mesh(mesh).world_size
    mp.spawn(fn, args=(world, _free_port(), *args), nprocs=world, join=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("megatron_recover"))


def _saved_run(root: str, mesh: str, kind: str, megatron: dict) -> tuple[str, str]:
    """The uninterrupted run of a case (once per module): the HF dir and the run's output dir."""
    hf_path = _hf_dir(root, kind)
    out = os.path.join(root, f"run-{mesh}-{kind}-{'-'.join(f'{k}={v}' for k, v in megatron.items())}")
    if not os.path.exists(f"{out}/losses.json"):
        os.makedirs(f"{out}/ckpt")  # the caller of save_state makes the (empty) directory
        _spawn(_run_and_save, mesh, hf_path, out, mesh, megatron)
    return hf_path, out


CASES = [
    ("d2p1t1", "untied", {}),  # DP=2, distributed optimizer (Adam moments sharded over DP)
    ("d2p1t1", "untied", {"distributed_optimizer": False}),  # DP=2, plain optimizer
    ("d1p1t2", "untied", {}),  # TP=2 with sequence parallel
    ("d1p2t1", "tied", {}),  # PP=2, tied embeddings across stages
    # PP=2 interleaved: two model chunks per rank
    ("d1p2t1", "tied", {"virtual_pipeline_stages": 2, "batch_p2p_comm": False, "overlap_p2p_comm": True}),
    ("d2p1t1e2", "moe", {}),  # EP=2: dense and expert optimizers chained
    ("d1p2t2", "tied", {}),  # TP=2 x PP=2
]


@pytest.mark.parametrize("mesh,kind,megatron", CASES, ids=[f"{m}-{k}-{i}" for i, (m, k, _) in enumerate(CASES)])
def test_restart_continues_exactly(root, mesh, kind, megatron):
    hf_path, out = _saved_run(root, mesh, kind, megatron)
    _spawn(_restart, mesh, hf_path, out, mesh, megatron)


def test_other_mesh_is_refused(root):
    hf_path, out = _saved_run(root, "d2p1t1", "untied", {})
    _spawn(_load_elsewhere, "d1p1t2", hf_path, f"{out}/ckpt", "d1p1t2")
