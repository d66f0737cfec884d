"""Optional Weights & Biases logging (logging.wandb): off by default and never required; when on, the
master logs every row of metrics.jsonl to one W&B run, and a W&B failure costs one warning, not the run.

No test touches the network: wandb runs offline, with its folders under tmp_path."""

import glob
import json
import logging
import os
import subprocess
import sys

import pytest
from conftest import skip_unless_ci

from realcore.launch.config_loader import ConfigError, load_config
from realcore.launch.validate import validate
from realcore.trainer.metrics import MetricsWriter, wandb_init_kwargs, wandb_run_id

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = "logging.wandb.project is set but the wandb package is not installed: pip install wandb"
TINY = ["experiment=ppo-math", "model=tiny", "dataset=tiny-arith", "allocation_mode=d1p1t1", "trainer.batch_size=4",
        "generation.n_samples=2", "generation.max_new_tokens=8", "eval.freq_steps=null"]


def need_wandb():
    try:
        import wandb  # noqa: F401
    except ImportError:
        skip_unless_ci("wandb is not installed (pip install -e '.[dev]')")


def offline_env(tmp_path) -> dict:
    """wandb kept off the network and out of the home directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path / "wandb-dir"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb-data"), WANDB_ARTIFACT_DIR=str(tmp_path / "wandb-artifacts"))
    return env


def wandb_records(path: str) -> list:
    """The records of a run's .wandb file, parsed with wandb's protobuf. The framing is LevelDB's log
    format, which wandb writes: a 7-byte file header (':W&B', magic, version), then 32 KiB blocks of
    chunks, each with a header of crc32 (4 bytes), length (2, little-endian) and type (1: whole
    record, 2/3/4: first/middle/last piece); a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, piece, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            out.append(record)
            piece = b""
    return out


def logged_history(path: str) -> dict[int, dict[str, float]]:
    """step -> the numbers wandb.log got at that step (wandb's own _step, _runtime, ... left out)."""
    rows = {}
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            # wandb puts a key in `key` or, as a path of one, in `nested_key` (our keys are flat)
            items = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            rows[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


# --- config and validation ---------------------------------------------------------------------

def test_off_by_default_and_the_package_is_not_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, find_spec says missing
    cfg = load_config([*TINY, "output_dir=/tmp/unused"])
    assert cfg.logging.wandb.project is None and wandb_init_kwargs(cfg) is None
    validate(cfg)


def test_validation_names_the_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config([*TINY, "output_dir=/tmp/unused", "logging.wandb.project=p"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == MISSING


def test_launch_without_the_package_fails_in_one_line_before_any_process(tmp_path):
    out = tmp_path / "run"
    code = ("import sys; sys.modules['wandb'] = None\n"  # as if wandb were not installed
            "from realcore.launch.launcher import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *TINY, f"output_dir={out}", f"model.cache_dir={tmp_path}/cache",
                        f"system.name_resolve.root={tmp_path}/nr", "logging.wandb.project=realcore-test"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"realcore: config error: {MISSING}"], r.stderr
    assert not out.exists()  # nothing started, nothing written


def test_init_arguments(tmp_path):
    base = [*TINY, f"output_dir={tmp_path}", "experiment_name=exp", "trial_name=t1", "logging.wandb.project=proj"]
    init = wandb_init_kwargs(load_config([*base, "rollout.server_token=s3cret", "logging.wandb.tags=[grpo,tiny]"]))
    assert (init["project"], init["name"], init["mode"], init["tags"], init["entity"]) == \
        ("proj", "exp/t1", "online", ["grpo", "tiny"], None)
    assert init["config"]["trainer"]["batch_size"] == 4  # the resolved config
    assert "s3cret" not in json.dumps(init["config"])  # a credential stays off W&B
    init = wandb_init_kwargs(load_config([*base, "logging.wandb.name=mine", "logging.wandb.mode=offline",
                                          "logging.wandb.group=g", "logging.wandb.entity=team"]))
    assert (init["name"], init["mode"], init["group"], init["entity"]) == ("mine", "offline", "g", "team")
    with pytest.raises(ConfigError, match="logging.wandb.mode"):
        load_config([*base, "logging.wandb.mode=cloud"])


def test_run_id_is_kept_on_resume_and_new_for_a_run_started_over(tmp_path):
    out = str(tmp_path / "run")
    first = wandb_run_id(out, resume_step=0)
    assert wandb_run_id(out, resume_step=5) == first == open(os.path.join(out, "wandb", "run_id")).read().strip()
    again = wandb_run_id(out, resume_step=0)  # the same output_dir, started from step 0
    assert again != first and wandb_run_id(out, resume_step=1) == again
    other = str(tmp_path / "other")  # resumed without a record (wandb was off until now): from the folder alone
    assert wandb_run_id(other, resume_step=3) == wandb_run_id(other + "/", resume_step=3) != again


# --- MetricsWriter: a W&B failure never ends the run -----------------------------------------------

ROWS = [{"step": s, "reward/mean": 0.25 * s, "loss": 1.0 / s, "time/step_s": 0.5, "version": s} for s in (1, 2, 3)]
INIT = dict(project="p", entity=None, name="e/t", group=None, tags=[], mode="offline", config={"seed": 1})


def write_rows(out: str, **kwargs) -> list[dict]:
    writer = MetricsWriter(out, len(ROWS), **kwargs)
    for row in ROWS:
        writer.write(row)
    writer.close()
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.parametrize("failure", ["init raises", "wandb missing"])
def test_wandb_failing_to_start_leaves_the_writer_working(tmp_path, monkeypatch, caplog, failure):
    if failure == "init raises":
        need_wandb()
        import wandb

        def refuse(**kwargs):
            raise wandb.errors.CommError("Network error (ConnectionError), entering retry loop")

        monkeypatch.setattr(wandb, "init", refuse)
    else:  # e.g. a master on a node whose Python lacks wandb (the launcher checked its own)
        monkeypatch.setitem(sys.modules, "wandb", None)
    with caplog.at_level(logging.WARNING, logger="realcore.metrics"):
        assert write_rows(str(tmp_path), wandb_init=INIT) == ROWS
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["wandb"], caplog.text
    assert ("CommError" if failure == "init raises" else "ModuleNotFoundError") in caplog.text


def test_wandb_failing_mid_run_stops_only_wandb(tmp_path, monkeypatch, caplog):
    need_wandb()
    import wandb

    calls = []

    class BrokenRun:
        def log(self, data, step):
            calls.append(step)
            raise wandb.errors.Error("the run's service process is gone")

        def finish(self):
            calls.append("finish")

    monkeypatch.setattr(wandb, "init", lambda **kwargs: BrokenRun())
    with caplog.at_level(logging.WARNING, logger="realcore.metrics"):
        assert write_rows(str(tmp_path), wandb_init=INIT) == ROWS
    assert calls == [1]  # one failure, then no more calls into wandb
    assert len(caplog.records) == 1 and "service process is gone" in caplog.text


def test_a_resumed_writer_continues_the_same_wandb_run(tmp_path, monkeypatch):
    need_wandb()
    import wandb

    for k, v in offline_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    out = str(tmp_path / "run")
    os.makedirs(out)
    try:
        write_rows(out, wandb_init=INIT)
        first = open(os.path.join(out, "wandb", "run_id")).read().strip()
        writer = MetricsWriter(out, 4, resume_step=2, wandb_init=INIT)  # the run failed after step 2's checkpoint
        writer.write({"step": 3, "reward/mean": 0.5, "time/step_s": 0.5})
        writer.write({"step": 4, "reward/mean": 0.75, "time/step_s": 0.5})
        writer.close()
    finally:
        wandb.teardown()  # stop this process's wandb service
    files = glob.glob(os.path.join(out, "wandb", "offline-run-*", "*.wandb"))  # one folder per attempt
    assert len(files) == 2 and all(f.endswith(f"run-{first}.wandb") for f in files), files
    before, after = sorted((logged_history(f) for f in files), key=min)
    assert sorted(before) == [1, 2, 3]
    assert after == {3: {"reward/mean": 0.5, "time/step_s": 0.5}, 4: {"reward/mean": 0.75, "time/step_s": 0.5}}


# --- a real run, offline -----------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_run_logs_every_step_to_an_offline_wandb_run(tmp_path):
    need_wandb()
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "realcore.launch", *TINY, "trainer.total_steps=3", f"output_dir={out}",
           f"model.cache_dir={tmp_path}/cache", f"system.name_resolve.root={tmp_path}/nr", "experiment_name=wb",
           "trial_name=t0", "logging.wandb.project=realcore-test", "logging.wandb.mode=offline",
           "logging.wandb.tags=[ci]", "rollout.server_token=s3cret"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=offline_env(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "wandb: not logging" not in r.stdout + r.stderr and "wandb: stopped" not in r.stdout + r.stderr
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in rows] == [1, 2, 3]

    run_id = open(os.path.join(out, "wandb", "run_id")).read().strip()
    files = glob.glob(os.path.join(out, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb"))
    assert len(files) == 1, os.listdir(os.path.join(out, "wandb"))
    history = logged_history(files[0])
    assert sorted(history) == [1, 2, 3]
    for m in rows:  # the same numbers as metrics.jsonl, reward included
        assert "reward/mean" in m
        assert history[m["step"]] == {k: v for k, v in m.items() if k != "step" and isinstance(v, (int, float))}
    (run,) = [x.run for x in wandb_records(files[0]) if x.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name, list(run.tags)) == (run_id, "realcore-test", "wb/t0", ["ci"])
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"]["total_steps"] == 3 and config["rollout"]["server_token"] == "<redacted>"
    assert not os.path.exists(tmp_path / "wandb-dir" / "wandb")  # the run's dir= wins over WANDB_DIR
