"""A launch into a used output_dir, and checkpoints replaced under a kill (real launches, real SIGKILL).

- A fresh launch into a folder holding another run's records is refused with one line (exit 2)
  and nothing in it changes; `recover_mode=resume` continues that run; `start_over=true` moves
  its records into `previous/DATE-TIME/` and a resume then finds only the new run's checkpoint.
- A recover checkpoint replaced (the same step saved again, or a newer one) by a writer SIGKILLed
  before or after any rename or delete always leaves a complete checkpoint that `latest()` finds,
  with the atomic swap and with the rename-aside fallback (filesystems without RENAME_EXCHANGE).
The Slurm case (a relaunch while the first job lives) is in tests/test_slurm.py; here only a Slurm
that cannot be asked (a refusal).
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNC = ["experiment=ppo-math", "model=tiny", "trainer.batch_size=4", "generation.n_samples=2",
        "generation.max_new_tokens=8", "trainer.recover_freq_steps=1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


def launch(out, *overrides, cache):
    cmd = [sys.executable, "-m", "realcore.launch", *SYNC, f"output_dir={out}", f"model.cache_dir={cache}",
           f"system.name_resolve.root={out}-nr", f"trial_name={os.path.basename(out)}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def used(tmp_path_factory, cache):
    """The output_dir of a finished 2-step run (records: metrics, ledger, recover/step_2, checkpoints)."""
    out = str(tmp_path_factory.mktemp("used") / "run")
    r = launch(out, "trainer.total_steps=2", cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def copy_of(used, tmp_path) -> str:
    out = str(tmp_path / "run")
    shutil.copytree(used, out, symlinks=True)
    return out


def snapshot(out) -> dict[str, tuple[int, int]]:
    return {os.path.relpath(os.path.join(d, f), out): (os.stat(os.path.join(d, f)).st_size,
                                                         os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, files in os.walk(out) for f in files if f != ".lock"}


def rows(path) -> list[dict]:
    return [json.loads(x) for x in open(path)]


def test_fresh_launch_into_records_is_refused_and_resume_continues(used, tmp_path, cache):
    out = copy_of(used, tmp_path)
    before = snapshot(out)
    r = launch(out, "trainer.total_steps=3", cache=cache)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds another run's records" in lines[0], r.stderr
    assert "recover_mode=resume" in lines[0] and "start_over=true" in lines[0]
    assert snapshot(out) == before  # nothing deleted, nothing written
    r = launch(out, "trainer.total_steps=3", "recover_mode=resume", cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 2" in r.stdout
    old = rows(os.path.join(used, "metrics.jsonl"))
    new = rows(os.path.join(out, "metrics.jsonl"))
    assert [m["step"] for m in new] == [1, 2, 3] and new[:2] == old  # continued, the old rows kept
    assert sorted(os.listdir(os.path.join(out, "recover"))) == ["step_3"]


def test_start_over_moves_the_records_aside(used, tmp_path, cache):
    from realcore.trainer import recover

    out = copy_of(used, tmp_path)
    before = snapshot(out)
    r = launch(out, "trainer.total_steps=1", "start_over=true", cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    (stamp,) = os.listdir(os.path.join(out, "previous"))
    aside = os.path.join(out, "previous", stamp)
    assert f"moved to {aside}" in r.stdout
    # Every file of the old run is there, as it was (the .secret and config.json included).
    assert {os.path.relpath(k, os.path.join("previous", stamp)): v for k, v in snapshot(out).items()
            if k.startswith("previous")} == before
    assert [m["step"] for m in rows(os.path.join(out, "metrics.jsonl"))] == [1]
    assert {m["step"] for m in rows(os.path.join(out, "ledger.jsonl"))} == {1}
    # A resume now finds the new run's checkpoint, never the old run's step 2.
    assert recover.latest(out) == (1, os.path.join(out, "recover", "step_1"))


WRITER = r'''
import json, os, shutil, signal, sys
from realcore.transport import durable
from realcore.trainer import recover

out, step, kill_at, swap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "swap"
if not swap:
    durable._renameat2 = None  # as on a filesystem without RENAME_EXCHANGE
events = [0]

def killing(fn):
    def call(*args, **kwargs):
        events[0] += 1
        if events[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return call

os.rename = killing(os.rename)
shutil.rmtree = killing(shutil.rmtree)
durable.exchange = killing(durable.exchange)
tmp = recover.begin(out, step)
os.makedirs(os.path.join(tmp, "model_worker-0"))
recover.write_json(os.path.join(tmp, "model_worker-0", "worker.json"), {"mark": "new"})
recover.write_json(os.path.join(tmp, "master.json"), {"mark": "new", "step": step})
recover.commit(tmp, out, step)
print("events", events[0])
'''


def write_checkpoint(out, step, mark):
    from realcore.trainer import recover

    tmp = recover.begin(out, step)
    os.makedirs(os.path.join(tmp, "model_worker-0"))
    recover.write_json(os.path.join(tmp, "model_worker-0", "worker.json"), {"mark": mark})
    recover.write_json(os.path.join(tmp, "master.json"), {"mark": mark, "step": step})
    recover.commit(tmp, out, step)


@pytest.mark.parametrize("swap", ["swap", "rename"])
@pytest.mark.parametrize("new_step", [2, 3], ids=["same-step", "next-step"])
def test_a_kill_while_a_checkpoint_is_replaced_leaves_one(tmp_path, swap, new_step):
    """SIGKILL the writer at each rename, swap and delete of the commit in turn (then once past
    the last): `latest()` always finds a whole checkpoint, the old one or the new one."""
    from realcore.trainer import recover

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    outcomes = []
    for kill_at in range(1, 20):
        out = str(tmp_path / f"k{kill_at}")
        write_checkpoint(out, 2, "old")
        p = subprocess.run([sys.executable, "-c", WRITER, out, str(new_step), str(kill_at), swap], env=env,
                           capture_output=True, text=True, timeout=60)
        found = recover.latest(out)
        assert found is not None, (kill_at, os.listdir(recover.root(out)))
        step, path = found
        master = recover.read_json(os.path.join(path, "master.json"))
        worker = recover.read_json(os.path.join(path, "model_worker-0", "worker.json"))
        assert master["mark"] == worker["mark"] and (step, master["mark"]) in ((2, "old"), (new_step, "new"))
        outcomes.append(master["mark"])
        if p.returncode == 0:  # the writer got past every event: the new checkpoint is the only one
            assert master["mark"] == "new" and os.listdir(recover.root(out)) == [f"step_{new_step}"]
            break
        assert p.returncode == -signal.SIGKILL, p.stderr
    else:
        pytest.fail("the writer never finished")
    assert "old" in outcomes and kill_at > 2  # the kills did land inside the replace


def test_a_slurm_that_cannot_be_asked_about_the_last_job_is_a_refusal(tmp_path, monkeypatch):
    """No squeue to ask (PATH without Slurm): a live job cannot be ruled out, so the launch stops."""
    from realcore.launch.config_loader import ConfigError
    from realcore.launch.slurm import refuse_live_job

    out = tmp_path / "run"
    (out / "slurm").mkdir(parents=True)
    refuse_live_job(str(out))  # no job submitted yet: nothing to ask
    (out / "slurm" / "job_id").write_text("42\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="cannot ask Slurm whether its job 42 still runs"):
        refuse_live_job(str(out))
