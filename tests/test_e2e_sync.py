"""End-to-end: the launcher starts a master and 2 model workers (DP=2 over gloo) as processes.

Real processes, real sockets, a real (tiny) model. Also: no process is left behind when a worker
is killed or the launcher is interrupted, and a forged message is dropped while the run goes on.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import zmq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model=tiny", "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8"]
KILL_TO_EXIT_S = 10.0  # a worker's death to the launcher's exit (a loaded CI machine: ~2 s idle)


def launch_cmd(out, *overrides, cache):
    return [sys.executable, "-m", "realcore.launch", "experiment=ppo-math", *TINY, f"output_dir={out}",
            f"model.cache_dir={cache}", f"system.name_resolve.root={out}/nr", *overrides]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; its parent (the test) may not have reaped it yet.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def assert_all_gone(out, timeout=15):
    pids = json.load(open(os.path.join(out, "pids.json")))
    deadline = time.time() + timeout
    while time.time() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.2)
    assert not [n for n, p in pids.items() if alive(p)], f"left behind: {pids}"
    return pids


BAD_LOG_LINE = re.compile(r"\bERROR\b|Traceback|Unclosed|Task was destroyed|never awaited")


def assert_clean_logs(out, *console: str) -> None:
    """A run that went as it should leaves no error in any log: every process's (OUTPUT_DIR/logs/)
    and the console's (the launcher and the master)."""
    texts = {name: open(os.path.join(out, "logs", name), errors="replace").read() for name in os.listdir(os.path.join(out, "logs"))}
    texts.update({f"console {i}": text for i, text in enumerate(console)})
    bad = [f"{name}: {line}" for name, text in texts.items() for line in text.splitlines() if BAD_LOG_LINE.search(line)]
    assert not bad, "\n".join(bad[:20])


def wait_for_metrics(out, n, proc, timeout=240):
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"launcher exited early with {proc.returncode}"
        if os.path.exists(path) and len(open(path).read().splitlines()) >= n:
            return
        time.sleep(0.3)
    raise AssertionError(f"no {n} metrics lines within {timeout} s")


def test_ppo_math_runs_to_completion(tmp_path, cache):
    out = str(tmp_path / "run")
    # The tiny model's rewards are all 0 at first, so no advantage moves it: the entropy bonus does,
    # so the checkpoint's weights must differ from the initial ones.
    r = subprocess.run(launch_cmd(out, "trainer.total_steps=3", "trainer.recover_freq_steps=3", "ppo.entropy_coef=0.01",
                                  "actor.optimizer.lr=1e-3", cache=cache), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        for key in ("reward/mean", "loss", "time/step_s", "time/actor_gen_s", "time/ref_inf_s", "time/actor_train_s"):
            assert key in m, key
    assert lines[-1]["version"] == 3
    assert open(os.path.join(out, "dfg.png"), "rb").read(4) == b"\x89PNG"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(out, "tensorboard")))
    assert "step 3/3" in r.stdout
    assert_checkpoint_is_the_trained_model(out, cache, steps=3)
    assert oct(os.stat(os.path.join(out, ".secret")).st_mode & 0o777) == "0o600"
    assert_all_gone(out)
    assert_clean_logs(out, r.stdout, r.stderr)


def assert_checkpoint_is_the_trained_model(out, cache, *, steps):
    """checkpoints/step_N holds the trainer's final weights (each data-parallel rank's, from its
    recover checkpoint of the same step, bit for bit) and they are not the initial model's."""
    import glob

    import torch
    from safetensors.torch import load_file

    saved = load_file(os.path.join(out, "checkpoints", f"step_{steps}", "model.safetensors"))
    (initial_file,) = glob.glob(os.path.join(cache, "tiny-*", "model.safetensors"))
    initial = load_file(initial_file)
    assert saved.keys() == initial.keys()
    changed = [k for k in saved if not torch.equal(saved[k], initial[k])]
    assert len(changed) > len(saved) // 2, f"only {changed} changed in training"
    ranks = sorted(glob.glob(os.path.join(out, "recover", f"step_{steps}", "model_worker-*", "actor", "engine.pt")))
    assert len(ranks) == 2, ranks
    for path in ranks:
        trained = torch.load(path, map_location="cpu", weights_only=True)["model"]
        assert all(torch.equal(saved[k], trained[k]) for k in saved), path


def _forge_and_ping(out):
    """Send a message signed with a wrong key to model_worker/0, then a real ping: it must be
    dropped, counted, and the worker must keep answering."""
    from realcore.api.config import ExperimentConfig
    from realcore.transport import keys, wire
    from realcore.transport.name_resolve import make_name_resolver
    from realcore.transport.protocol import Exit, Ping, request

    cfg = ExperimentConfig.model_validate_json(open(os.path.join(out, "config.json")).read())
    addr = json.loads(make_name_resolver(cfg.system.name_resolve, wire.load_secret(os.path.join(out, ".secret"))).get(
        keys.model_worker(cfg, 0)))["control"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secret = wire.load_secret(os.path.join(out, ".secret"))
    wire.secure(sock, secret, server=False, limits=wire.Limits.of(cfg.system))  # the run's CURVE keys
    sock.connect(addr)
    me = wire.Endpoint(secret, "test", socket="test")
    wire.send(sock, request(Exit(), 1), endpoint=wire.Endpoint(b"not-the-secret" * 3, "forger", socket="test"), to=addr)
    wire.send(sock, request(Ping(), -99), endpoint=me, to=addr)
    _, header, _ = wire.recv(sock, endpoint=me, timeout_s=10)
    sock.close()
    return header


def test_killed_worker_stops_everything(tmp_path, cache):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(launch_cmd(out, "trainer.total_steps=1000", "system.shutdown_timeout_s=30", cache=cache), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, 1, proc)
        header = _forge_and_ping(out)
        assert header["ok"] and header["body"]["dropped"] == 1 and header["body"]["state"] == "running"
        assert header["body"]["drops"] == {"control/mac": 1}
        wait_for_metrics(out, 2, proc)  # the forged EXIT changed nothing
        pids = json.load(open(os.path.join(out, "pids.json")))
        os.kill(pids["model_worker/1"], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "model_worker/1 died (killed by SIGKILL)" in err
    # Nobody waits on the dead worker: the launcher sees the death (it polls every 0.2 s), and the
    # master and the other worker exit on its SIGTERM at once. A wait for the dead one's EXIT reply
    # (as the master did) or for the grace period would take system.shutdown_timeout_s, 30 s here.
    assert took < KILL_TO_EXIT_S, f"the run ended {took:.1f} s after the kill"
    assert_all_gone(out)


def test_interrupt_stops_everything(tmp_path, cache):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(launch_cmd(out, "trainer.total_steps=1000", cache=cache), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, 1, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert_all_gone(out)


def test_killed_launcher_takes_workers_down(tmp_path, cache):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(launch_cmd(out, "trainer.total_steps=1000", cache=cache), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_metrics(out, 1, proc)
        proc.kill()  # SIGKILL: no clean-up code runs; the kernel's parent-death signal must
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert_all_gone(out)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.totl_steps=5", "trainer.totl_steps: unknown key"),
        ("trainer.total_steps=five", "trainer.total_steps: Input should be a valid integer"),
        ("mfcs.2.inputs=[input_ids,loss_mask,behav_logprobs,rewardz,ref_logprobs]",
         "mfcs[2] (actor_train).inputs: key 'rewardz' has no producer"),
        ("mfcs.0.inputs=[prompt_ids,ref_logprobs]", "mfcs: cycle actor_gen -> ref_inf -> actor_gen"),
        # A model-parallel mesh picks Megatron, which samples on servers only.
        ("allocation_mode=d2p2t1", "actor.backend=megatron samples on generation servers; use allocation_mode=local.d1+d2p2t1"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, override, message):
    r = subprocess.run([sys.executable, "-m", "realcore.launch", "experiment=ppo-math", f"output_dir={tmp_path}", override],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_sft_math_lowers_the_loss(tmp_path, cache):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=sft-math", "model=tiny", "trainer.total_steps=8",
           f"output_dir={out}", f"model.cache_dir={cache}", f"system.name_resolve.root={out}/nr"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in open(os.path.join(out, "metrics.jsonl"))]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert os.path.exists(os.path.join(out, "checkpoints", "step_8", "model.safetensors"))


def test_dfg_show_writes_png(tmp_path):
    png = tmp_path / "g.png"
    r = subprocess.run([sys.executable, "-m", "realcore.dfg", "show", "experiment=ppo-math", f"out={png}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "actor_train [ppo_update on actor]" in r.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
