"""SGLang/vLLM servers as tasks of a cluster run: the job steps and placement groups they get, the
checks, and the task itself (realcore/launch/engine_server.py) run for real with the built-in
server standing in for SGLang (the test switch REALCORE_TEST_ENGINE_BUILTIN=1: the same command
line with `python -m realcore.serve`). The runs under real Slurm and Ray are in test_slurm.py and
test_ray.py."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from realcore.api.alloc import parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.backends.models import prepare_model
from realcore.backends.clients.registry import engine_available, server_command
from realcore.launch.config_loader import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg_of(*overrides) -> ExperimentConfig:
    return load_config(["experiment=async-ppo-math", "model=tiny", *overrides])


def test_the_test_switch_runs_the_builtin_server_with_sglangs_flags(monkeypatch):
    monkeypatch.setenv("REALCORE_TEST_ENGINE_BUILTIN", "1")
    argv, env = server_command("sglang", model_path="/m", host="127.0.0.1", port=5, tp=1, seed=3, max_batch_size=8,
                               cuda=False)
    assert argv[1:3] == ["-m", "realcore.serve"] and set(env) <= {"GLOO_SOCKET_IFNAME"}
    assert argv[3:] == ["--model-path", "/m", "--host", "127.0.0.1", "--port", "5", "--tp-size", "1",
                        "--random-seed", "3", "--max-running-requests", "8"]
    assert engine_available("sglang") is None  # the stand-in needs no SGLang
    monkeypatch.delenv("REALCORE_TEST_ENGINE_BUILTIN")
    argv, _ = server_command("sglang", model_path="/m", host="h", port=5, tp=2, pp=2, seed=0, max_batch_size=8, cuda=True)
    assert argv[1:3] == ["-m", "sglang.launch_server"] and argv[-4:-2] == ["--pp-size", "2"]
    argv, _ = server_command("vllm", model_path="/m", host="h", port=5, tp=2, pp=2, seed=0, max_batch_size=8, cuda=True)
    assert argv[-4:-2] == ["--pipeline-parallel-size", "2"] and "--tensor-parallel-size" in argv
    assert argv[-2:] == ["--dtype", "bfloat16"]  # generation.dtype auto on a GPU


def test_slurm_gives_each_engine_server_tp_times_pp_gpus():
    from realcore.launch.slurm import steps

    cfg = cfg_of("scheduler=slurm", "allocation_mode=sglang.d4p1t2+d2p2t2", "slurm.gpus_per_node=8")
    by_kind = {s.kind: s for s in steps(cfg, parse_allocation_mode(cfg.allocation_mode))}
    assert (by_kind["gen_server"].ntasks, by_kind["gen_server"].gpus_per_task) == (4, 2)
    assert (by_kind["model_worker"].ntasks, by_kind["model_worker"].gpus_per_task) == (8, 1)
    cfg = cfg_of("scheduler=slurm", "allocation_mode=vllm.d1p2t4+d2", "slurm.gpus_per_node=8")
    assert next(s for s in steps(cfg, parse_allocation_mode(cfg.allocation_mode)) if s.kind == "gen_server").gpus_per_task == 8
    cfg = cfg_of("scheduler=slurm", "allocation_mode=sglang.d1p1t8+d2", "slurm.gpus_per_node=4")
    with pytest.raises(ValueError, match="does not fit on a node of slurm.gpus_per_node=4"):
        steps(cfg, parse_allocation_mode(cfg.allocation_mode))
    cfg = cfg_of("scheduler=slurm", "allocation_mode=sglang.d2p1t2+d2")  # by default SGLang asks for GPUs
    assert {s.kind: s.gpus_per_task for s in steps(cfg, parse_allocation_mode(cfg.allocation_mode))
            if s.gpus_per_task} == {"model_worker": 1, "gen_server": 2}
    for argv in (["slurm.gpus_per_node=0", "allocation_mode=sglang.d2p1t2+d2"], ["allocation_mode=local.d2+d2"]):
        cfg = cfg_of("scheduler=slurm", *argv)  # no GPUs asked for (CPU nodes, or the built-in engine's default)
        assert {s.gpus_per_task for s in steps(cfg, parse_allocation_mode(cfg.allocation_mode))} == {0}


def test_dry_run_shows_the_server_steps(tmp_path):
    r = subprocess.run([sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "model=tiny",
                        f"model.cache_dir={tmp_path}/cache", f"output_dir={tmp_path}/run", "scheduler=slurm",
                        "allocation_mode=sglang.d4p1t2+d2p2t2", "slurm.gpus_per_node=8", "--dry-run"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    server = next(x for x in lines if x.startswith("start gen_server srun"))
    assert "--ntasks=4" in server and "--gpus-per-task=2" in server, server
    assert "# 4 sglang server(s) (tp 2, pp 1), 2 GPU(s) each" in lines[lines.index(server) - 1]
    workers = next(x for x in lines if x.startswith("start model_worker srun"))
    assert "--ntasks=8" in workers and "--gpus-per-task=1" in workers, workers
    assert "# 8 model worker(s): the training mesh d2p2t2, 1 GPU(s) each" in lines[lines.index(workers) - 1]


def test_dry_run_shows_its_plan_then_why_the_model_does_not_fit(tmp_path):
    """The default model (9 attention heads) cannot be split by server TP 2: the dry run still
    prints the steps (GPUs requested by default for SGLang), then the one-line error, exit 2."""
    from test_models import SMOLLM2_CACHE  # the converted SmolLM2 shared with test_models (~30 s to build)

    r = subprocess.run([sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", f"model.cache_dir={SMOLLM2_CACHE}",
                        f"output_dir={tmp_path}/run", "scheduler=slurm", "allocation_mode=sglang.d4p1t2+d2p2t2",
                        "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert "# 4 sglang server(s) (tp 2, pp 1), 2 GPU(s) each, each started by its task" in lines
    assert "# 8 model worker(s): the training mesh d2p2t2, 1 GPU(s) each" in lines
    assert r.stderr.strip().splitlines()[-1].startswith("realcore: config error: allocation_mode: sglang servers of tp 2 "
                                                        "split attention heads"), r.stderr[-2000:]


def test_the_default_model_refuses_server_tp_that_splits_its_heads(tmp_path):
    """SmolLM2-135M has 9 attention heads: TP 2 cannot split them (SGLang would fail at start-up)."""
    from realcore.launch.validate import ConfigError, check_model_layout

    cfg = cfg_of("allocation_mode=sglang.d1p1t2+d1", f"model.cache_dir={tmp_path}", "model.tiny.num_attention_heads=3",
                 "model.tiny.num_key_value_heads=1", "model.tiny.hidden_size=48")
    cfg.model.path = prepare_model(cfg.model, cfg.seed)
    with pytest.raises(ConfigError, match="has 3; use a tp that divides 3"):
        check_model_layout(cfg, parse_allocation_mode(cfg.allocation_mode))


def test_model_parallel_training_mesh_defaults_to_megatron():
    assert cfg_of("allocation_mode=sglang.d1+d2p2t2").actor.backend == "megatron"
    assert cfg_of("allocation_mode=local.d1+d2").actor.backend == "torch"
    assert cfg_of("allocation_mode=d2p1t2", "actor.backend=torch").actor.backend == "torch"  # an explicit choice stays


def test_ray_places_each_engine_server_on_tp_times_pp_gpus():
    from realcore.launch.ray_scheduler import mesh_bundles, worker_specs

    cfg = cfg_of("scheduler=ray", "allocation_mode=sglang.d3p1t2+d2", "ray.gpus_per_worker=1")
    alloc = parse_allocation_mode(cfg.allocation_mode)
    assert mesh_bundles(cfg, alloc) == {"model_worker": (2, {"CPU": 1.0, "GPU": 1}),
                                        "gen_server": (3, {"CPU": 1.0, "GPU": 2})}
    assert [s for s in worker_specs(cfg, alloc) if s[1] == "gen_server"] == [(f"gen_server/{i}", "gen_server", i)
                                                                             for i in range(3)]
    cfg = cfg_of("scheduler=ray", "allocation_mode=sglang.d3p1t2+d2")  # CPU only
    assert all("GPU" not in b for _, b in mesh_bundles(cfg, alloc).values())


def test_engine_checks_happen_on_the_node_under_a_cluster_scheduler():
    from realcore.launch.validate import ConfigError, check_generation_servers

    # This venv has no vLLM: a local run is refused at once, a cluster run leaves it to the node.
    cfg = cfg_of("allocation_mode=vllm.d1+d1")
    with pytest.raises(ConfigError, match="vllm is not installed"):
        check_generation_servers(cfg, parse_allocation_mode(cfg.allocation_mode))
    cfg = cfg_of("allocation_mode=vllm.d1+d1", "scheduler=slurm")
    check_generation_servers(cfg, parse_allocation_mode(cfg.allocation_mode))
    cfg = cfg_of("allocation_mode=sglang.d1c2+d1", "scheduler=slurm")
    with pytest.raises(ConfigError, match="take dN, pN and tN only"):
        check_generation_servers(cfg, parse_allocation_mode(cfg.allocation_mode))


def test_engine_task_gives_its_server_a_memory_share_and_dtype(tmp_path, monkeypatch):
    """Slurm and Ray give a server GPUs of its own: 0.85 of each unless rollout.server_mem_fraction
    says otherwise, generation.dtype as configured; whether it is on a GPU, the task's own torch
    tells (cuda=None: its CUDA_VISIBLE_DEVICES, set by Slurm or Ray)."""
    from realcore.launch import engine_server

    seen = []

    def command(engine, **kw):
        seen.append(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_server, "server_command", command)
    monkeypatch.setattr(engine_server, "engine_available", lambda *a: None)
    for extra, fraction in (((), 0.85), (("rollout.server_mem_fraction=0.5", "generation.dtype=float32"), 0.5)):
        cfg = cfg_of("allocation_mode=sglang.d1p1t2+d1", f"output_dir={tmp_path}", *extra)
        with pytest.raises(RuntimeError, match="stop here"):
            engine_server.serve_engine(cfg, 0)
        assert seen[-1]["mem_fraction"] == fraction and seen[-1].get("cuda") is None and seen[-1]["tp"] == 2
    assert [kw["dtype"] for kw in seen] == ["auto", "float32"]


# ---- the task itself, as a real process ----


def _run_dir(tmp_path, allocation_mode="sglang.d1+d1"):
    from realcore.transport.wire import write_secret

    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / ".heartbeat").mkdir()
    cfg = cfg_of(f"model.cache_dir={tmp_path.parent}/engine-models", f"output_dir={out}",
                 f"allocation_mode={allocation_mode}", f"trial_name={tmp_path.name}", "system.startup_timeout_s=120")
    cfg.model.path = prepare_model(cfg.model, cfg.seed)
    (out / "config.json").write_text(cfg.model_dump_json())
    write_secret(str(out / ".secret"))
    return cfg, out


def _start_task(out, **env):
    argv = [sys.executable, "-m", "realcore.launch.run_worker", "--type", "gen_server", "--index", "0", "--world", "1",
            "--config", f"{out}/config.json", "--secret-file", f"{out}/.secret", "--n-servers", "1"]
    log = open(f"{out}/logs/gen_server-0.log", "ab")
    return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "REALCORE_TEST_ENGINE_BUILTIN": "1", **env})


def _published(cfg, proc, timeout=120) -> dict:
    from realcore.transport import keys
    from realcore.transport.name_resolve import make_name_resolver

    from realcore.transport.wire import load_secret

    resolver = make_name_resolver(cfg.system.name_resolve, load_secret(f"{cfg.output_dir}/.secret"))
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, open(f"{cfg.output_dir}/logs/gen_server-0.log").read()[-3000:]
        try:
            return json.loads(resolver.get(keys.gen_server(cfg, 0)))
        except Exception:
            time.sleep(0.3)
    raise AssertionError("the server was not published in time")


def _engine_pids(out) -> list[int]:
    """The engine processes (realcore.serve standing in for SGLang) of this run: its key file is in out."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{d}/cmdline", "rb").read().decode().split("\0")
            state = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if "realcore.serve" in argv and any(a.startswith(f"{out}/.engine/") for a in argv) and state != "Z":
            found.append(int(d))
    return found


def _get(url, token, path="/v1/models"):
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, json.loads(r.read() or b"null")


def _token(out):
    from realcore.backends.server_launch import server_token
    from realcore.transport.wire import load_secret

    return server_token(load_secret(f"{out}/.secret"))


@pytest.mark.timeout(180)
def test_engine_task_publishes_a_ready_server_and_stops_it_with_itself(tmp_path):
    cfg, out = _run_dir(tmp_path)
    proc = _start_task(out)
    try:
        addr = _published(cfg, proc)
        assert addr["weights"] is None and addr["http"].startswith("http://127.0.0.1:")
        assert _get(addr["http"], _token(out))[0] == 200  # ready when published, and it wants the run's token
        with pytest.raises(urllib.error.HTTPError, match="401"):
            _get(addr["http"], None)
        key_dir = out / ".engine" / "gen_server-0"
        assert oct(os.stat(key_dir).st_mode & 0o777) == "0o700" and os.listdir(key_dir)
        assert _token(out) not in " ".join(open(f"/proc/{p}/cmdline").read() for p in _engine_pids(out))
        engines = _engine_pids(out)
        assert len(engines) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
    finally:
        proc.kill()
    deadline = time.time() + 10
    while _engine_pids(out) and time.time() < deadline:
        time.sleep(0.2)
    assert _engine_pids(out) == [], "the engine outlived its task"


@pytest.mark.timeout(180)
def test_engine_that_exits_on_its_own_fails_its_task(tmp_path):
    """Even with exit code 0 (SGLang exits 0 on SIGTERM): a server that ends unasked is a failure,
    so the task runner restarts it."""
    cfg, out = _run_dir(tmp_path)
    proc = _start_task(out)
    try:
        _published(cfg, proc)
        [engine] = _engine_pids(out)
        os.kill(engine, signal.SIGTERM)  # realcore.serve exits 0 on SIGTERM
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()
    assert "exited on its own (exit code 0)" in open(f"{out}/logs/gen_server-0.log").read()


@pytest.mark.timeout(120)
def test_engine_missing_on_the_node_is_one_line_and_exit_1(tmp_path):
    cfg, out = _run_dir(tmp_path, "vllm.d1+d1")  # this venv has no vLLM
    proc = _start_task(out)
    assert proc.wait(timeout=60) == 1
    log = open(f"{out}/logs/gen_server-0.log").read()
    assert "cannot start the vllm server on this node: vllm is not installed" in log, log[-2000:]
