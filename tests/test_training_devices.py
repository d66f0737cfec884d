"""How a model worker takes its device and builds its training mesh, and how it hands weights to
memory-updated servers. GPUs and NCCL are mocked here (a CPU has neither), each test says which;
the real thing runs in the GPU-gated tests (test_fsdp, test_megatron_bf16, test_weight_broadcast)."""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

import torch

from realcore.transport import rendezvous


class _Resolver:
    secret = b"t" * 32  # rank 0 writes the run's proof into its store with it

    def __init__(self):
        self.kv = {}

    def put(self, key, value, replace=False):
        self.kv[key] = value

    def wait(self, key, timeout_s):
        return self.kv[key]


def _cfg():
    from realcore.launch.config_loader import load_config

    return load_config(["experiment=async-ppo-math", "model=tiny"])


def _init_mesh_with(monkeypatch, device):
    """init_mesh's call to init_process_group (mocked: NCCL needs GPUs), and the socket variables."""
    calls = []
    monkeypatch.setattr(rendezvous.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    rendezvous.init_mesh(_cfg(), _Resolver(), 0, 1, device)
    (backend, kw), = calls
    return backend, kw


def test_a_mesh_on_gpus_is_nccl_bound_to_the_ranks_gpu(monkeypatch):
    """Mocks init_process_group (NCCL needs GPUs): a rank on cuda:1 makes an NCCL group bound to
    cuda:1 (device_id), with gloo and NCCL sockets on system.host's interface."""
    from realcore.transport.interfaces import gloo_ifname

    backend, kw = _init_mesh_with(monkeypatch, torch.device("cuda", 1))
    assert backend == "nccl" and kw["device_id"] == torch.device("cuda", 1)
    assert kw["rank"] == 0 and kw["world_size"] == 1 and kw["timeout"] == timedelta(seconds=1800)
    assert os.environ["NCCL_SOCKET_IFNAME"] == "=" + gloo_ifname("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == gloo_ifname("127.0.0.1")


def test_a_mesh_on_the_cpu_is_gloo(monkeypatch):
    for device in (torch.device("cpu"), None):
        backend, kw = _init_mesh_with(monkeypatch, device)
        assert backend == "gloo" and "device_id" not in kw
        assert "NCCL_SOCKET_IFNAME" not in os.environ


def test_a_model_worker_selects_its_device_before_its_mesh(monkeypatch):
    """Mocks the GPU: select_device answers cuda:0 (what a process given one GPU in its
    CUDA_VISIBLE_DEVICES gets) and init_mesh records what it is given."""
    from realcore.backends import device
    from realcore.trainer.model_worker import ModelWorker

    order = []
    monkeypatch.setattr(device, "select_device", lambda name="auto": order.append("select") or torch.device("cuda", 0))
    monkeypatch.setattr(rendezvous, "init_mesh", lambda cfg, resolver, rank, world, dev, mesh: order.append(
        ("mesh", rank, world, dev, mesh)))
    # Worker 3 of a run whose second mesh (workers 2-5) holds it: rank 1 of that mesh's world of 4.
    worker = SimpleNamespace(cfg=None, resolver=None, index=3, world=6, rank=1, mesh=SimpleNamespace(world_size=4),
                             mesh_index=1)
    ModelWorker._init_process_group(worker)
    assert order == ["select", ("mesh", 1, 4, torch.device("cuda", 0), 1)] and worker.device == torch.device("cuda", 0)


class _CountsHostCopies(torch.Tensor):
    copies = 0

    def cpu(self, *args, **kwargs):
        type(self).copies += 1
        return super().cpu(*args, **kwargs)


def test_a_memory_update_copies_the_weights_to_the_host_once_for_all_servers(monkeypatch):
    """Three servers, one copy of each tensor to the host (the engine's tensors stand for GPU ones:
    the copies are counted), and every server gets the same host tensors."""
    from realcore.backends.clients import sglang_api as gen_client
    from realcore.trainer.model_worker import ModelWorker
    from realcore.transport.protocol import PublishWeights

    state = {"a": torch.randn(4, 3).as_subclass(_CountsHostCopies), "b": torch.randn(5).as_subclass(_CountsHostCopies)}
    pushed = []
    monkeypatch.setattr(gen_client, "push_weights", lambda address, secret, version, sd, *a, **kw: pushed.append(sd))
    cfg = _cfg()
    engine = SimpleNamespace(hf_state_dict=lambda: state)
    worker = SimpleNamespace(cfg=cfg, engines={"actor": engine}, index=0, control=SimpleNamespace(secret=b"s" * 32), policy="actor",
                             _sharded=lambda role: False)
    _CountsHostCopies.copies = 0
    published = ModelWorker.publish_weights(worker, PublishWeights(version=1, servers=["x", "y", "z"]))
    assert published.failed == [] and len(pushed) == 3
    assert _CountsHostCopies.copies == len(state)  # once per tensor, not once per tensor and server
    assert all(p.keys() == state.keys() and all(p[k] is pushed[0][k] for k in p) for p in pushed)
