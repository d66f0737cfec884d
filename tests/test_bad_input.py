"""Bad input stops the launch before any worker starts: exit 2, one line naming the key or file.

Each case runs the real `python -m realcore.launch` (tiny model). Also: one launcher per output_dir,
race-free (two launches a second apart: exactly one runs), while one trial launched into two
output_dirs runs twice, each run with its own name-resolution keys; and the
training mesh's torch.distributed store listens on the chosen address only, on a port nobody can
take between its choice and its use.
"""

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model=tiny", "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8"]
SYNC = ["experiment=ppo-math", *TINY]
ASYNC = ["experiment=async-ppo-math", "eval.freq_steps=null", *TINY, "dataset=tiny-arith", "allocation_mode=local.d1p1t1+d1p1t1", "rollout.n_workers=1"]
# Without workers a refused launch is imports + config + model/dataset reads: seconds. The bound is
# loose for a loaded CI machine; that no worker started is shown by the missing logs/ and pids.json.
REFUSED_WITHIN_S = 60


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="module")
def tiny_dir(cache):
    from realcore.api.config import ModelConfig
    from realcore.backends.models import prepare_model

    return prepare_model(ModelConfig(cache_dir=cache), seed=1)


def cmd(out, *overrides, cache, base=SYNC, nr=None):
    return [sys.executable, "-m", "realcore.launch", *base, f"output_dir={out}", f"model.cache_dir={cache}",
            f"system.name_resolve.root={nr or os.path.join(str(out), 'nr')}", *overrides]


def refused(out, *overrides, cache, base=SYNC) -> str:
    """Launch; assert exit 2 with one stderr line, quickly, with no worker started; return the line."""
    t0 = time.monotonic()
    r = subprocess.run(cmd(out, *overrides, cache=cache, base=base), cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("realcore: config error: "), r.stderr
    assert took < REFUSED_WITHIN_S, f"{took:.0f} s"
    if os.path.isdir(out):
        assert not {"logs", "pids.json", "config.json"} & set(os.listdir(out)), os.listdir(out)
    return lines[0]


def broken_model(tiny_dir, dest, how):
    shutil.copytree(tiny_dir, dest)
    if how == "truncated safetensors":
        path = os.path.join(dest, "model.safetensors")
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "config.json not json":
        with open(os.path.join(dest, "config.json"), "w") as f:
            f.write('{"model_type": "qwen2", "hidden_si')
    elif how == "config.json unknown model":
        with open(os.path.join(dest, "config.json"), "w") as f:
            json.dump({"model_type": "no-such-model"}, f)
    return str(dest)


# --- config and input errors ------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, names", [
    (["reward.type=nope"], ["reward.type", "'nope'", "math"]),
    (["dataset.type=nope"], ["dataset.type", "'nope'", "tiny-arith"]),
    (["generation.max_new_tokens=5000"], ["generation.max_new_tokens", "5000", "2048"]),
    (["generation.max_new_tokens=2040"], ["generation.max_new_tokens", "longest prompt"]),
    (["trial_name=a/b"], ["trial_name", "'a/b'"]),
    (["trial_name=.."], ["trial_name", "'..'"]),
    (["experiment_name=x..y"], ["experiment_name"]),
    (["rollout.filter_equal_reward_groups=true"], ["rollout.filter_equal_reward_groups", "async mode only"]),
    (["dataset.max_prompt_len=3"], ["dataset.type=tiny-arith", "no usable row", "prompt too long 256", "max_prompt_len"]),
])
def test_sync_config_errors(tmp_path, cache, overrides, names):
    line = refused(str(tmp_path / "run"), *overrides, cache=cache)
    for name in names:
        assert name in line, line


@pytest.mark.parametrize("overrides, names", [
    (["dataset.type=nope"], ["dataset.type", "'nope'"]),
    (["reward.type=nope"], ["reward.type", "'nope'"]),
    (["rollout.workflow=nope"], ["rollout.workflow", "'nope'"]),
    (["generation.max_new_tokens=4000"], ["generation.max_new_tokens"]),
])
def test_async_config_errors(tmp_path, cache, overrides, names):
    line = refused(str(tmp_path / "run"), *overrides, cache=cache, base=ASYNC)
    for name in names:
        assert name in line, line


def test_missing_jsonl(tmp_path, cache):
    path = tmp_path / "nope.jsonl"
    line = refused(str(tmp_path / "run"), "dataset=gsm8k", f"dataset.path={path}", cache=cache)
    assert "dataset.path" in line and str(path) in line


@pytest.mark.parametrize("base", [SYNC, ASYNC], ids=["sync", "async"])
def test_dataset_with_no_usable_row_gives_the_skip_counts(tmp_path, cache, base):
    path = tmp_path / "bad.jsonl"
    path.write_text('{not json\n{"question": "What is 1 + 1?"}\n[1, 2]\n{"answer": "3"}\n')
    line = refused(str(tmp_path / "run"), "dataset=gsm8k", f"dataset.path={path}", cache=cache, base=base)
    assert str(path) in line and "no usable row (4 rows; skipped bad json 2, missing field 2)" in line, line


def test_an_empty_shard_is_named(tmp_path, cache):
    """2 data-parallel shards; rows 0, 2 (shard 0) are fine, rows 1, 3 (shard 1) are not."""
    path = tmp_path / "half.jsonl"
    good = json.dumps({"question": "What is 1 + 1?", "answer": "2"})
    path.write_text(f"{good}\n{{bad\n{good}\n{{\"question\": \"q\"}}\n")
    line = refused(str(tmp_path / "run"), "dataset=gsm8k", f"dataset.path={path}", cache=cache)
    assert "shard 1 of 2" in line and "bad json 1, missing field 1" in line, line


def test_a_1mb_question_prints_only_realcores_line(tmp_path, cache):
    """Tokenizing it makes transformers warn "Token indices sequence length is longer than ...":
    the one line the launcher prints must be the only one."""
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"question": "What is 1 + 1? " * 70_000, "answer": "2"}) + "\n")
    assert path.stat().st_size > 1_000_000
    line = refused(str(tmp_path / "run"), "dataset=gsm8k", f"dataset.path={path}", cache=cache)
    assert "no usable row" in line and "prompt too long 1" in line, line


def test_a_host_this_machine_does_not_have_is_refused_before_any_worker(tmp_path, cache):
    """192.0.2.1 (TEST-NET-1) is nobody's address: binding it fails (EADDRNOTAVAIL), in the launcher."""
    line = refused(str(tmp_path / "run"), "system.host=192.0.2.1", cache=cache, base=ASYNC)
    assert "system.host" in line and "'192.0.2.1'" in line and "cannot bind" in line, line
    line = refused(str(tmp_path / "run"), "system.host=no-such-host.invalid", cache=cache)
    assert "system.host" in line and "does not resolve" in line, line


@pytest.mark.parametrize("how, names", [
    ("truncated safetensors", ["model.safetensors", "truncated"]),
    ("config.json not json", ["config.json", "not valid JSON"]),
    ("config.json unknown model", ["config.json", "no-such-model"]),
])
def test_broken_model_directory(tmp_path, cache, tiny_dir, how, names):
    path = broken_model(tiny_dir, tmp_path / "model", how)
    line = refused(str(tmp_path / "run"), f"model.path={path}", cache=cache)
    assert "model.path" in line and path in line, line
    for name in names:
        assert name in line, line


def test_unwritable_output_dir(tmp_path, cache):
    (tmp_path / "a_file").write_text("")
    out = str(tmp_path / "a_file" / "run")  # under a regular file: no one can create it, root included
    line = refused(out, cache=cache, base=[*SYNC, f"system.name_resolve.root={tmp_path / 'nr'}"])
    assert line.startswith(f"realcore: config error: output_dir: cannot create {out}"), line
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "read-only"
        ro.mkdir(mode=0o500)
        line = refused(str(ro), cache=cache, base=[*SYNC, f"system.name_resolve.root={tmp_path / 'nr'}"])
        assert "output_dir" in line and str(ro) in line, line


def test_async_launcher_reports_the_dataset_counts(tmp_path, cache, capsys):
    """What the sync master prints for its model workers' shards, the launcher prints in async mode
    (the rollout workers hold the dataset there)."""
    from realcore.launch.launcher import check_all

    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{bad\n')
    argv = cmd(tmp_path / "run", "dataset=gsm8k", f"dataset.path={path}", cache=cache, base=ASYNC)[3:]
    with contextlib.ExitStack() as held:
        check_all(argv, False, held)
    assert "realcore: dataset: 2 rows, 1 usable, skipped bad json 1" in capsys.readouterr().out


# --- one launcher per output_dir; one trial in two output_dirs ------------------------------------


def race(first: list[str], second: list[str], apart_s: float = 1.0) -> tuple[subprocess.Popen, subprocess.CompletedProcess]:
    """Start two launches `apart_s` apart; return (the one that ran, the one refused), after checking
    that exactly one ran to the end and the other was refused while the winner was still running."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    a = subprocess.Popen(first, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(apart_s)
    b = subprocess.Popen(second, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [a, b]
    try:
        deadline = time.monotonic() + 300
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither launch ended"
            time.sleep(0.1)
        loser = next(p for p in procs if p.poll() is not None)
        winner = b if loser is a else a
        assert winner.poll() is None, "the refused launch ended only after the other one"
        out, err = loser.communicate()
        assert loser.returncode == 2, out[-2000:] + err[-2000:]
        assert len(err.splitlines()) == 1, err
        w_out, w_err = winner.communicate(timeout=300)
        assert winner.returncode == 0, w_out[-2000:] + w_err[-2000:]
        return winner, subprocess.CompletedProcess(loser.args, 2, out, err)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_two_launches_of_one_output_dir_exactly_one_runs(tmp_path, cache):
    out = str(tmp_path / "run")
    launch = cmd(out, "trainer.total_steps=2", "trial_name=racer", cache=cache)
    winner, loser = race(launch, launch)
    assert f"output_dir {out} is in use by pid {winner.pid} (trial ppo-math/racer)" in loser.stderr, loser.stderr
    assert json.load(open(os.path.join(out, ".lock")))["pid"] == winner.pid
    with open(os.path.join(out, ".lock")) as f:  # released when the winner ended
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def metrics_lines(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    return len(open(path).read().splitlines()) if os.path.exists(path) else 0


def wait_for_steps(out: str, n: int, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while metrics_lines(out) < n:
        assert proc.poll() is None, f"the launch in {out} ended early with {proc.returncode}"
        assert time.monotonic() < deadline, f"no {n} steps in {out} within {timeout_s} s"
        time.sleep(0.3)


def test_one_trial_in_two_output_dirs_runs_twice(tmp_path, cache):
    """The same experiment/trial (as two launches that both keep the default trial0 would) in one
    name-resolution store, two output_dirs: the second runs to the end beside the live first, which
    keeps its own keys and goes on training."""
    from realcore.api.config import ExperimentConfig
    from realcore.transport import keys
    from realcore.transport.name_resolve import make_name_resolver
    from realcore.transport.wire import load_secret

    nr = str(tmp_path / "nr")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(cmd(a, "trainer.total_steps=1000", "trial_name=same", cache=cache, nr=nr), cwd=REPO,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(a, 1, first)
        second = subprocess.run(cmd(b, "trainer.total_steps=2", "trial_name=same", cache=cache, nr=nr), cwd=REPO,
                                env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
        assert metrics_lines(b) == 2
        done_a = metrics_lines(a)
        wait_for_steps(a, done_a + 1, first)  # the first run was not disturbed
        scopes = set()
        for out in (a, b):  # each run's model workers under its own scope, published by its own processes
            cfg = ExperimentConfig.model_validate_json(open(os.path.join(out, "config.json")).read())
            resolver = make_name_resolver(cfg.system.name_resolve, load_secret(os.path.join(out, ".secret")))
            pids = json.load(open(os.path.join(out, "pids.json")))
            for i in range(2):
                assert json.loads(resolver.get(keys.model_worker(cfg, i)))["pid"] == pids[f"model_worker/{i}"]
            scopes |= {k.split("/")[2] for k in resolver.find("ppo-math/same")}  # a run reads its own entries only
        assert len(scopes) == 2
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
        assert first.returncode == 130, err[-2000:]
    finally:
        first.kill()
        first.wait()


HOLDER = """
import sys, time
from realcore.api.config import ExperimentConfig, MFCConfig, NameResolveConfig, SystemConfig
from realcore.launch.run_lock import hold_run
cfg = ExperimentConfig(experiment_name="lock", trial_name="t", output_dir=sys.argv[1], mfcs=[MFCConfig(name="n", type="t")],
                       system=SystemConfig(name_resolve=NameResolveConfig(root=sys.argv[2])))
with hold_run(cfg):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_killed_launcher_leaves_its_lock_free(tmp_path):
    """While a launcher holds an output_dir, that output_dir is refused and another one (same
    experiment/trial) is not; kill -9 of the holder frees the lock at once (recover_mode=resume/auto
    relaunches the same command)."""
    from realcore.api.config import ExperimentConfig, MFCConfig, NameResolveConfig, SystemConfig
    from realcore.launch.config_loader import ConfigError
    from realcore.launch.run_lock import hold_run

    out, nr = str(tmp_path / "run"), str(tmp_path / "nr")

    def cfg(output_dir):
        return ExperimentConfig(experiment_name="lock", trial_name="t", output_dir=output_dir, mfcs=[MFCConfig(name="n", type="t")],
                                system=SystemConfig(name_resolve=NameResolveConfig(root=nr)))

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, out, nr], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=rf"^output_dir {out} is in use by pid {holder.pid} \(trial lock/t\)"):
            with hold_run(cfg(out)):
                pass
        with hold_run(cfg(str(tmp_path / "elsewhere"))):
            pass
    finally:
        holder.kill()
        holder.wait()
    with hold_run(cfg(out)):
        assert json.load(open(os.path.join(out, ".lock")))["pid"] == os.getpid()


# --- the torch.distributed store ------------------------------------------------------------------------


def listening(pid: int) -> list[tuple[str, int]]:
    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
                  if c.status == psutil.CONN_LISTEN)


def test_store_listens_on_its_host_only():
    import torch.distributed as dist

    from realcore.transport.rendezvous import serve_store

    store = serve_store("127.0.0.1", 2, timedelta(seconds=10))
    # Only this store's port: earlier tests in this process may have left sockets of their own.
    assert [a for a in listening(os.getpid()) if a[1] == store.port] == [("127.0.0.1", store.port)]
    client = dist.TCPStore("127.0.0.1", store.port, 2, False, timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    for addr in ("127.0.0.1", "0.0.0.0"):  # the port is held from the start: nobody can take it
        with socket.socket() as s, pytest.raises(OSError) as e:
            s.bind((addr, store.port))
        assert e.value.errno == errno.EADDRINUSE


MESH_SECRET = b"m" * 32  # the two ranks' run secret (name_resolve entries are signed with it)


def _mesh_rank(rank: int, root: str, result_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from realcore.api.config import ExperimentConfig, MFCConfig, NameResolveConfig, SystemConfig
    from realcore.transport.name_resolve import make_name_resolver
    from realcore.transport.rendezvous import init_mesh

    cfg = ExperimentConfig(experiment_name="rdv", trial_name="t", output_dir=result_dir,
                           mfcs=[MFCConfig(name="n", type="sft_update")],
                           system=SystemConfig(name_resolve=NameResolveConfig(root=root), request_timeout_s=60,
                                               startup_timeout_s=60))
    init_mesh(cfg, make_name_resolver(cfg.system.name_resolve, MESH_SECRET), rank, 2)
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"sum": x.item(), "listening": listening(os.getpid())}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_mesh_rendezvous_binds_the_chosen_address_and_keeps_its_port(tmp_path):
    """Two real processes over gloo. While they start, a squatter tries to take the published port
    the moment it is published (what made the old bind-close-publish-rebind sequence fail): it cannot,
    and the mesh comes up; every listening socket of the mesh is on 127.0.0.1."""
    import torch.multiprocessing as mp

    from realcore.api.config import ExperimentConfig, MFCConfig, NameResolveConfig
    from realcore.transport import keys
    from realcore.transport.name_resolve import make_name_resolver

    root = str(tmp_path / "nr")
    resolver = make_name_resolver(NameResolveConfig(root=root), MESH_SECRET)
    squatted: list[int] = []
    key = keys.dist_init(ExperimentConfig(experiment_name="rdv", trial_name="t", output_dir=str(tmp_path),
                                          mfcs=[MFCConfig(name="n", type="sft_update")]))

    def squat():
        address = resolver.wait(key, timeout_s=120, poll_s=0.001)
        port = int(address.rsplit(":", 1)[1])
        for addr in ("127.0.0.1", "0.0.0.0"):
            with socket.socket() as s:
                try:
                    s.bind((addr, port))
                except OSError as e:
                    squatted.append(e.errno)

    thread = threading.Thread(target=squat, daemon=True)
    thread.start()
    mp.spawn(_mesh_rank, args=(root, str(tmp_path)), nprocs=2, join=True)
    thread.join(timeout=10)
    assert squatted == [errno.EADDRINUSE, errno.EADDRINUSE]
    for rank in range(2):
        r = json.load(open(tmp_path / f"rank{rank}.json"))
        assert r["sum"] == 3.0
        assert r["listening"] and all(ip == "127.0.0.1" for ip, _ in r["listening"]), r


def test_gloo_is_pointed_at_the_interface_of_the_host(monkeypatch):
    from realcore.transport.interfaces import bind_gloo_to

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    bind_gloo_to("127.0.0.1")
    name = os.environ["GLOO_SOCKET_IFNAME"]
    assert "127.0.0.1" in [a.address for a in psutil.net_if_addrs()[name]]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    bind_gloo_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine"  # the user's choice stays
