"""Placement under scheduler=local (realcore/launch/placement.py): which GPUs each process gets.

This machine has no GPU. The plan is computed on the GPUs the launcher is told the node has:
`system.gpus`, or the test switch REALCORE_TEST_NODE_GPUS=N (GPUs 0..N-1). Under the switch the
processes really start with those CUDA_VISIBLE_DEVICES; they see no CUDA device under those ids
(there is none) and run on the CPU, so the end-to-end run below is a real run whose environments
are read from /proc. What a GPU does with the ids (NCCL, memory) is not exercised here.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from realcore.api.alloc import parse_allocation_mode
from realcore.launch.config_loader import ConfigError, load_config
from realcore.launch.placement import TEST_SWITCH, make_plan, node_gpus, process_names

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOTS8 = [str(i) for i in range(8)]


def cfg_of(*overrides):
    return load_config(["experiment=async-ppo-math", "model=tiny", *overrides])


def plan_of(allocation_mode, slots, *overrides, source="test"):
    cfg = cfg_of(f"allocation_mode={allocation_mode}", *overrides)
    alloc = parse_allocation_mode(cfg.allocation_mode)
    return cfg, alloc, make_plan(cfg, alloc, slots, source)


def visible(cfg, alloc, plan) -> dict:
    """process name -> the CUDA_VISIBLE_DEVICES it gets (None: left as inherited)."""
    return {name: plan.env(name).get("CUDA_VISIBLE_DEVICES") for name in process_names(cfg, alloc)}


# --- the plan ----------------------------------------------------------------------------------


def test_decoupled_servers_first_then_one_gpu_per_training_rank():
    cfg, alloc, plan = plan_of("local.d4p1t1+d4p1t1", SLOTS8)
    assert visible(cfg, alloc, plan) == {
        **{f"gen_server/{i}": str(i) for i in range(4)}, **{f"model_worker/{r}": str(4 + r) for r in range(4)},
        "gserver_manager": "", "rollout_worker/0": "", "master": ""}


def test_colocated_rank_r_on_gpu_r():
    cfg, alloc, plan = plan_of("d8p1t1", SLOTS8, "mode=sync")
    assert visible(cfg, alloc, plan) == {**{f"model_worker/{r}": str(r) for r in range(8)}, "master": ""}


def test_sglang_server_of_tp2_gets_two_gpus():
    cfg, alloc, plan = plan_of("sglang.d2p1t2+d4p1t1", SLOTS8)
    env = visible(cfg, alloc, plan)
    assert (env["gen_server/0"], env["gen_server/1"]) == ("0,1", "2,3")
    assert [env[f"model_worker/{r}"] for r in range(4)] == ["4", "5", "6", "7"]
    assert plan.mem_fraction("gen_server/0", None) == 0.85  # GPUs of its own


def test_a_gpu_named_twice_holds_two_processes_and_halves_the_server_memory():
    cfg, alloc, plan = plan_of("sglang.d1p1t1+d1p1t1", ["0", "0"], "system.gpus=['0','0']")
    assert plan.gpus == {"gen_server/0": ("0",), "model_worker/0": ("0",)}
    assert plan.sharing("gen_server/0") == 2 and plan.mem_fraction("gen_server/0", None) == 0.425
    assert plan.mem_fraction("gen_server/0", 0.3) == 0.3  # rollout.server_mem_fraction wins
    with pytest.raises(ConfigError, match="gen_server/0 would get GPU 0 twice"):  # TP ranks need distinct GPUs
        plan_of("sglang.d1p1t2+d1", ["0", "0", "1"])


def test_too_few_gpus_is_one_line_naming_both_numbers():
    with pytest.raises(ConfigError) as e:
        plan_of("local.d4p1t1+d5p1t1", SLOTS8, source=f"{TEST_SWITCH}=8")
    assert "needs 9 GPUs" in str(e.value) and "this node has 8" in str(e.value) and "\n" not in str(e.value)


def test_no_gpu_is_the_empty_plan_and_changes_no_environment():
    cfg, alloc, plan = plan_of("local.d2+d2", [], source="the visible CUDA devices")
    assert set(visible(cfg, alloc, plan).values()) == {None}
    # system.gpus=[] asks for the CPU on a node that may have GPUs: every process is kept off them.
    cfg, alloc, plan = plan_of("local.d2+d2", [], "system.gpus=[]", source="system.gpus")
    assert set(visible(cfg, alloc, plan).values()) == {""}


def test_builtin_servers_on_the_cpu_hold_no_gpu():
    cfg, alloc, plan = plan_of("local.d2+d2", SLOTS8, "generation.device=cpu")
    env = visible(cfg, alloc, plan)
    assert env["gen_server/0"] == env["gen_server/1"] == "" and env["model_worker/0"] == "0"


def test_the_nodes_gpus(monkeypatch):
    import torch

    monkeypatch.delenv(TEST_SWITCH, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert node_gpus(cfg_of()) == ([], "the visible CUDA devices")  # this machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # as NVML would count on a GPU node
    assert node_gpus(cfg_of())[0] == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # the launcher's own share of the node
    assert node_gpus(cfg_of())[0] == ["3", "5"]
    monkeypatch.setenv(TEST_SWITCH, "4")
    assert node_gpus(cfg_of())[0] == ["0", "1", "2", "3"]
    assert node_gpus(cfg_of("system.gpus=['GPU-a','GPU-b']"))[0] == ["GPU-a", "GPU-b"]  # the key wins


# --- what the plan rules out (rollout.weight_update=nccl) -------------------------------------


def test_nccl_refused_when_trainer_rank_0_shares_a_gpu_with_a_server():
    from realcore.launch.validate import check_placement

    cfg = cfg_of("allocation_mode=local.d1+d1", "rollout.weight_update=nccl", "system.gpus=['0','0']")
    with pytest.raises(ConfigError, match="trainer rank 0 and gen_server/0 on GPU 0 share a GPU.*use rollout.weight_update=memory or disk"):
        check_placement(cfg, parse_allocation_mode(cfg.allocation_mode))
    cfg = cfg_of("allocation_mode=local.d1+d1", "rollout.weight_update=disk", "system.gpus=['0','0']")
    assert check_placement(cfg, parse_allocation_mode(cfg.allocation_mode)).sharing("gen_server/0") == 2


def test_nccl_refused_with_one_side_on_the_cpu(monkeypatch):
    from realcore.launch.slurm import steps
    from realcore.launch.placement import check_nccl
    from realcore.launch.validate import check_placement

    monkeypatch.setenv(TEST_SWITCH, "8")
    cfg = cfg_of("allocation_mode=local.d2+d2", "rollout.weight_update=nccl", "generation.device=cpu")
    with pytest.raises(ConfigError, match="NCCL needs both on GPUs.*trainer is on a GPU while the generation servers "
                                          r"are on the CPU \(generation.device=cpu\)"):
        check_placement(cfg, parse_allocation_mode(cfg.allocation_mode))
    monkeypatch.delenv(TEST_SWITCH)  # every CPU run: both on the CPU, gloo, allowed
    cfg = cfg_of("allocation_mode=local.d2+d2", "rollout.weight_update=nccl")
    assert not check_placement(cfg, parse_allocation_mode(cfg.allocation_mode)).gpus
    # Slurm: the step that has GPUs decides
    cfg = cfg_of("scheduler=slurm", "allocation_mode=local.d2+d2", "rollout.weight_update=nccl",
                 "generation.device=cpu", "slurm.gpus_per_node=8")
    alloc = parse_allocation_mode(cfg.allocation_mode)
    gpus = {s.kind: s.gpus_per_task for s in steps(cfg, alloc)}
    assert gpus["model_worker"] == 1 and gpus["gen_server"] == 0
    with pytest.raises(ConfigError, match="NCCL needs both on GPUs"):
        check_nccl(cfg, alloc, trainer_on_gpu=True, servers_on_gpu=False)


def test_slurm_asks_sinfo_for_the_gpus_per_node(monkeypatch):
    from realcore.launch import slurm

    answers = {"gpu:8\n(null)\n": 8, "gpu:a100:4(S:0-1)\ngpu:h100:8(S:0,1)\n": 4, "(null)\n": 0, "gpu:2,gpu:v100:2\n": 4}
    for out, n in answers.items():
        monkeypatch.setattr(slurm.subprocess, "run", lambda argv, out=out, **kw: subprocess.CompletedProcess(argv, 0, out, ""))
        assert slurm.sinfo_gpus_per_node("gpu") == n, out
    monkeypatch.setattr(slurm.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "fatal"))
    assert slurm.sinfo_gpus_per_node(None) is None  # sinfo failing: unknown

    def missing(argv, **kw):
        raise FileNotFoundError(argv[0])

    monkeypatch.setattr(slurm.subprocess, "run", missing)
    cfg = cfg_of("scheduler=slurm", "allocation_mode=local.d2+d2")
    slurm.resolve_gpus_per_node(cfg)
    assert cfg.slurm.gpus_per_node is None  # unknown: no GPUs for built-in servers, as before
    monkeypatch.setattr(slurm.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(argv, 0, "gpu:4\n", ""))
    slurm.resolve_gpus_per_node(cfg)
    assert {s.kind: s.gpus_per_task for s in slurm.steps(cfg, parse_allocation_mode(cfg.allocation_mode))
            if s.gpus_per_task} == {"model_worker": 1, "gen_server": 1}


def test_ray_gpus_per_worker_follows_the_cluster():
    from realcore.launch.ray_scheduler import cluster_gpus_per_worker, describe_bundles

    cfg = cfg_of("scheduler=ray", "allocation_mode=sglang.d2p1t2+d2")
    assert cluster_gpus_per_worker(cfg, {"CPU": 8.0, "GPU": 8.0}) == 1
    assert cluster_gpus_per_worker(cfg, {"CPU": 8.0}) == 0
    text = describe_bundles(cfg, parse_allocation_mode(cfg.allocation_mode))
    assert "gen_server: a placement group of 2 bundle(s) {'CPU': 1.0, 'GPU': 2}" in text
    assert cluster_gpus_per_worker(cfg_of("scheduler=ray", "ray.gpus_per_worker=0"), {"GPU": 8.0}) == 0


def test_engine_servers_and_their_restarts_get_their_gpus(tmp_path):
    """start_engine_servers on a plan: each SGLang server (a stand-in interpreter that records what
    it was given) starts, and starts again as a restart does, with its GPUs and SGLang's GPU flags."""
    from realcore.launch.launcher import prepare_output, start_engine_servers
    from realcore.launch.validate import validate

    record = tmp_path / "seen.jsonl"
    exe = tmp_path / "engine-env" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                   f"open({str(record)!r}, 'a').write(json.dumps([os.environ.get('CUDA_VISIBLE_DEVICES'), sys.argv]) + '\\n')\n")
    exe.chmod(0o755)
    cfg = cfg_of("allocation_mode=sglang.d2p1t2+d2", f"output_dir={tmp_path / 'run'}", f"rollout.server_python={exe}",
                 f"system.name_resolve.root={tmp_path / 'nr'}", "system.gpus=['0','1','2','3','0','5']")
    dfg, alloc = validate(cfg)
    prepare_output(cfg, dfg)
    cfg.model.path = "/models/tiny"
    plan = make_plan(cfg, alloc, cfg.system.gpus, "system.gpus")
    procs = start_engine_servers(cfg, alloc, dict(os.environ), str(tmp_path / "run" / "logs"), plan)
    for p in procs:
        assert p.popen.wait(30) == 0
        p.restart()
        assert p.popen.wait(30) == 0
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    seen = [(gpus, argv) for gpus, argv in seen if argv[1:3] == ["-m", "sglang.launch_server"]]  # not validate's probe
    assert sorted(gpus for gpus, _ in seen) == ["0,1", "0,1", "2,3", "2,3"]
    for gpus, argv in seen:  # GPU 0 also holds model_worker/0: server 0 takes half the share
        fraction = "0.425" if gpus == "0,1" else "0.85"
        assert argv[argv.index("--mem-fraction-static") + 1] == fraction and "--device" not in argv, argv
        assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--tp-size") + 1] == "2", argv


# --- the launcher, as a user runs it -----------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


def launch_argv(out, cache, *overrides):
    return [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "model=tiny", "dataset=tiny-arith",
            "eval.freq_steps=null", f"output_dir={out}", f"model.cache_dir={cache}", *overrides]


def env_of(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (TEST_SWITCH, "CUDA_VISIBLE_DEVICES")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def printed_plan(stdout: str) -> dict:
    """process -> CUDA_VISIBLE_DEVICES, from the plan the launcher prints."""
    found = re.findall(r"^  (\S+)\s+CUDA_VISIBLE_DEVICES=(\S*)", stdout, re.M)
    return {name: value.strip('"') for name, value in found}


def environments_while_running(argv, out, env, wait_for: str) -> tuple[dict, subprocess.CompletedProcess]:
    """Start a run, wait until OUTPUT_DIR/`wait_for` exists, read the environment each process
    started with (/proc/PID/environ of every pid the launcher lists), then SIGINT the launcher."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(os.path.join(out, wait_for)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"no {wait_for} after 240 s"
            time.sleep(0.5)
        with open(os.path.join(out, "pids.json")) as f:
            pids = json.load(f)
        envs = {}
        for name, pid in pids.items():
            with open(f"/proc/{pid}/environ", "rb") as f:
                envs[name] = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return envs, subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def test_eight_gpus_four_servers_four_ranks_as_the_dry_run_printed(tmp_path, cache):
    """The acceptance run: local.d4p1t1+d4p1t1 on a node the launcher is told has 8 GPUs. After
    the first training step (so the processes run, on the CPU here, with those ids), every
    process's environment is read from /proc and matches the plan `--dry-run` printed."""
    out = str(tmp_path / "run")
    argv = launch_argv(out, cache, "allocation_mode=local.d4p1t1+d4p1t1", "trainer.total_steps=1000",
                       "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8",
                       f"system.name_resolve.root={tmp_path}/nr")
    env = env_of(**{TEST_SWITCH: "8"})
    dry = subprocess.run(argv + ["--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    planned = printed_plan(dry.stdout)
    assert planned == {**{f"gen_server/{i}": str(i) for i in range(4)},
                       **{f"model_worker/{r}": str(4 + r) for r in range(4)},
                       "gserver_manager": "", "rollout_worker/0": "", "master": ""}, dry.stdout
    assert not os.path.exists(out)  # a dry run writes nothing there

    envs, r = environments_while_running(argv, out, env, "metrics.jsonl")
    held = {name: e.get(b"CUDA_VISIBLE_DEVICES", b"<unset>").decode() for name, e in envs.items()}
    assert held == planned, (held, planned)
    assert printed_plan(r.stdout) == planned  # the run prints its plan too
    assert r.returncode == 130, r.stderr[-2000:]


def test_dry_run_of_sglang_servers_of_tp2(tmp_path, cache):
    """The plan of sglang.d2p1t2+d4p1t1: each server on 2 GPUs, its command line with the matching
    TP, memory share and bf16. SGLang is not installed here and the launcher refuses an engine it
    cannot find, so an empty stand-in package `sglang` goes on PYTHONPATH: the dry run only looks
    the package up, and prints SGLang's own command (REALCORE_TEST_ENGINE_BUILTIN would swap in
    realcore.serve's)."""
    stand_in = tmp_path / "stand-in"
    (stand_in / "sglang").mkdir(parents=True)
    (stand_in / "sglang" / "__init__.py").write_text("")
    env = env_of(**{TEST_SWITCH: "8", "PYTHONPATH": os.pathsep.join([REPO, str(stand_in)])})
    out = str(tmp_path / "run")
    r = subprocess.run(launch_argv(out, cache, "allocation_mode=sglang.d2p1t2+d4p1t1", "mode=async", "--dry-run"),
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = printed_plan(r.stdout)
    assert (plan["gen_server/0"], plan["gen_server/1"]) == ("0,1", "2,3") and plan["model_worker/3"] == "7"
    commands = [line.split("$ ", 1)[1] for line in r.stdout.splitlines() if line.strip().startswith("$ ")]
    assert len(commands) == 2
    for c in commands:
        assert "-m sglang.launch_server" in c and "--tp-size 2" in c, c
        assert "--mem-fraction-static 0.85" in c and "--dtype bfloat16" in c, c
        assert "--device cpu" not in c, c
    assert not os.path.exists(out)


def test_nine_gpus_on_eight_exits_2_and_starts_nothing(tmp_path, cache):
    out = str(tmp_path / "run")
    r = subprocess.run(launch_argv(out, cache, "allocation_mode=local.d4p1t1+d5p1t1"), cwd=REPO,
                       env=env_of(**{TEST_SWITCH: "8"}), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs 9 GPUs" in lines[0] and "this node has 8" in lines[0], r.stderr
    assert not os.path.exists(out)  # nothing started, nothing written


def test_without_gpus_the_environments_are_as_before(tmp_path, cache):
    """No switch on this CPU machine: the empty plan, no CUDA_VISIBLE_DEVICES added anywhere, and
    no plan printed."""
    out = str(tmp_path / "run")
    argv = launch_argv(out, cache, "allocation_mode=local.d1+d1", "trainer.total_steps=1000",
                       f"system.name_resolve.root={tmp_path}/nr")
    envs, r = environments_while_running(argv, out, env_of(), os.path.join(".heartbeat", "master"))
    assert set(envs) == {"master", "model_worker/0", "gen_server/0", "gserver_manager", "rollout_worker/0"}
    for name, e in envs.items():
        assert b"CUDA_VISIBLE_DEVICES" not in e, name
    assert "placement" not in r.stdout and r.returncode == 130, r.stderr[-2000:]
