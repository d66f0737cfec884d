"""What the launcher exposes to other users of the machine: its logs (0600 in a 0700 folder, no
token or secret in them, SGLang's own start-up line included), a server's address published only
once the process we started listens on it (the token goes with every probe), the token kept off
the command line."""

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

import sglang_standin
from realcore.backends.server_launch import wait_own_listener
from realcore.backends.server_launch import redact_line
from realcore.launch.local import open_log, private_logs_dir, spawn_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_redaction_covers_sglangs_line_and_the_flag_forms():
    line = sglang_standin.server_args_line(type("A", (), dict(
        model_path="/m", host="127.0.0.1", port=5, max_running_requests=8, device="cpu", tp_size=1, random_seed=0,
        api_key="tok-123"))())
    assert "api_key='tok-123'" in line  # SGLang's format, as the stand-in prints it
    assert b"tok-123" not in redact_line(line.encode(), ())  # by its form alone, the value unknown
    for raw in (b"--api-key tok-123 --port 5", b'api-key: "tok-123"', b"Bearer tok-123", b"secret aa11ff"):
        out = redact_line(raw, (b"tok-123", b"aa11ff"))
        assert b"tok-123" not in out and b"aa11ff" not in out, out
    assert redact_line(b"an api_key is required", ()) == b"an api_key is required"  # prose stays


def test_logs_folder_and_files_are_private(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    old = logs / "old.log"
    old.write_text("x")
    os.chmod(old, 0o644)
    private_logs_dir(str(logs))  # an existing folder is tightened, with what it holds
    assert stat.S_IMODE(os.stat(logs).st_mode) == 0o700 and stat.S_IMODE(os.stat(old).st_mode) == 0o600
    os.umask(old_umask := os.umask(0o022))
    try:
        open_log(str(logs / "new.log")).close()
        os.chmod(old, 0o644)
        open_log(str(old)).close()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(logs / "new.log").st_mode) == 0o600 and stat.S_IMODE(os.stat(old).st_mode) == 0o600


def test_a_captured_engine_log_is_filtered(tmp_path):
    """The real path: a child's output through spawn_command's pipe into its log."""
    log = tmp_path / "gen.log"
    code = "import sys; print(\"server_args=ServerArgs(api_key='k-secret', port=1)\"); print('x s3cr3t y', file=sys.stderr)"
    p = spawn_command("gen_server/0", [sys.executable, "-c", code], env=dict(os.environ), log_path=str(log),
                      redact=("k-secret", "s3cr3t"))
    assert p.popen.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while log.read_text().count("\n") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    text = log.read_text()
    assert "k-secret" not in text and "s3cr3t" not in text and "api_key=<redacted>" in text, text
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600


def test_a_port_someone_else_bound_first_is_never_probed(tmp_path):
    """A local user binds the port the launcher picked before the engine does: the launcher must not
    send its token there. The engine here never listens; the thief's socket must see no connection."""
    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    thief.settimeout(0.2)
    port = thief.getsockname()[1]
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="another process listens on it"):
            wait_own_listener(engine, port, timeout_s=2)
        with pytest.raises(socket.timeout):
            thief.accept()
    finally:
        engine.kill()
        engine.wait()
        thief.close()
    with pytest.raises(RuntimeError, match="exited"):
        wait_own_listener(engine, port, timeout_s=2)


def test_the_engines_own_listener_is_found(tmp_path):
    """The HTTP server may be a child of the process we started (SGLang's and vLLM's are not always)."""
    code = ("import socket, subprocess, sys, time\n"
            "c = 'import socket, time; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(30)'\n"
            "p = subprocess.Popen([sys.executable, '-c', c]); p.wait()\n")
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(engine.stdout.readline())
        wait_own_listener(engine, port, timeout_s=10)  # returns: the grandchild's socket is ours
    finally:
        for child in __import__("psutil").Process(engine.pid).children(recursive=True):
            child.kill()
        engine.kill()
        engine.wait()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("tok-from-file-0123456789\n")
    os.chmod(path, 0o600)
    return path


def test_an_sglang_run_leaves_no_token_or_secret_in_its_logs(tmp_path, token_file):
    """A whole async run on SGLang's launch path (tests/sglang_standin.py logs SGLang's server_args
    line, api_key included). Every log is 0600 in a 0700 folder (an existing 0755 folder included),
    no log holds the token or the run's secret, and the token was never on a command line."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True, mode=0o755)
    os.chmod(out / "logs", 0o755)
    python = sglang_standin.interpreter(tmp_path / "sglang-env")
    token = token_file.read_text().strip()
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "model=tiny", "dataset=tiny-arith",
           "allocation_mode=sglang.d1p1t1+d1p1t1", f"rollout.server_python={python}", "rollout.n_workers=1",
           "rollout.max_concurrent_rollouts=4", "trainer.batch_size=2", "generation.n_samples=2",
           "generation.max_new_tokens=8", "trainer.total_steps=1", f"output_dir={out}",
           f"model.cache_dir={tmp_path}/cache", f"system.name_resolve.root={tmp_path}/nr",
           "trial_name=h-launch-security", "eval.freq_steps=null", f"rollout.server_token_file={token_file}"]
    cmdlines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def watch() -> None:  # every command line of the run, as `ps` shows them to any user
        import psutil

        while not done.is_set():
            try:
                for c in psutil.Process(proc.pid).children(recursive=True):
                    cmdlines.append(" ".join(c.cmdline()))
            except psutil.Error:
                pass
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        raise AssertionError(f"the run stalled\n{stderr[-3000:]}")
    finally:
        done.set()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert any("sglang.launch_server" in c for c in cmdlines), cmdlines[:5]
    assert not [c for c in cmdlines if token in c]
    secret = open(out / ".secret", "rb").read()
    from realcore.transport.wire import load_secret

    needles = {token, load_secret(str(out / ".secret")).hex()}
    assert stat.S_IMODE(os.stat(out / "logs").st_mode) == 0o700
    names = sorted(os.listdir(out / "logs"))
    assert "gen_server-0.log" in names, names
    for name in names:
        path = out / "logs" / name
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, name
        text = path.read_bytes()
        for needle in needles:
            assert needle.encode() not in text, (name, needle)
        assert secret not in text
    server_log = (out / "logs" / "gen_server-0.log").read_text()
    assert "server_args=ServerArgs(" in server_log and "api_key=<redacted>" in server_log, server_log[:2000]
    assert token not in stdout + stderr


def test_ray_tasks_carry_only_what_workers_need():
    from realcore.launch.ray_scheduler import task_env

    env = {"PATH": "/bin", "PYTHONPATH": "/w", "OMP_NUM_THREADS": "1", "NCCL_SOCKET_IFNAME": "=ib0",
           "CUDA_VISIBLE_DEVICES": "0", "TOKENIZERS_PARALLELISM": "false", "REALCORE_TEST_ENGINE_BUILTIN": "1",
           "HF_HOME": "/h", "HF_TOKEN": "hf_x", "WANDB_API_KEY": "w", "REALCORE_SERVER_TOKEN": "t",
           "AWS_SECRET_ACCESS_KEY": "a", "GITHUB_TOKEN": "g", "SSH_AUTH_SOCK": "/s", "MY_APP_SETTING": "x"}
    assert set(task_env(env)) == {"PATH", "PYTHONPATH", "OMP_NUM_THREADS", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES",
                                  "TOKENIZERS_PARALLELISM", "REALCORE_TEST_ENGINE_BUILTIN", "HF_HOME"}


def test_the_token_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch, token_file):
    from realcore.launch.config_loader import ConfigError, load_config
    from realcore.launch.launcher import resolve_server_token

    def resolved(*overrides):
        cfg = load_config(["experiment=async-ppo-math", "model=tiny", *overrides])
        resolve_server_token(cfg)
        return cfg.rollout.server_token

    monkeypatch.delenv("REALCORE_SERVER_TOKEN", raising=False)
    assert resolved() is None  # derived from the run's secret by each process
    assert resolved(f"rollout.server_token_file={token_file}") == "tok-from-file-0123456789"
    monkeypatch.setenv("REALCORE_SERVER_TOKEN", "tok-from-env")
    assert resolved() == "tok-from-env"
    assert resolved("rollout.server_token=given") == "given"
    os.chmod(token_file, 0o644)
    for overrides, words in ([[f"rollout.server_token_file={token_file}"], ["readable", "chmod 600"]],
                             [[f"rollout.server_token_file={tmp_path}/none"], ["cannot read"]],
                             [[f"rollout.server_token_file={token_file}", "rollout.server_token=x"], ["both set"]]):
        with pytest.raises(ConfigError) as e:
            resolved(*overrides)
        assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), e.value


def test_slurm_output_files_are_created_private_before_the_job(tmp_path):
    """srun would create them with the job's umask; it appends to an existing file and keeps its mode."""
    from realcore.api.alloc import parse_allocation_mode
    from realcore.launch.config_loader import load_config
    from realcore.launch.launcher import precreate_slurm_logs

    cfg = load_config(["experiment=async-ppo-math", "model=tiny", "scheduler=slurm", f"output_dir={tmp_path}",
                       "allocation_mode=sglang.d2p1t1+d2p1t1", "rollout.n_workers=2", "slurm.gpus_per_node=0"])
    private_logs_dir(str(tmp_path / "logs"))
    precreate_slurm_logs(cfg, parse_allocation_mode(cfg.allocation_mode))
    names = sorted(os.listdir(tmp_path / "logs"))
    assert names == ["gen_server-0.log", "gen_server-1.log", "gserver_manager-0.log", "master.out",
                     "model_worker-0.log", "model_worker-1.log", "rollout_worker-0.log", "rollout_worker-1.log"]
    assert all(stat.S_IMODE(os.stat(tmp_path / "logs" / n).st_mode) == 0o600 for n in names)
