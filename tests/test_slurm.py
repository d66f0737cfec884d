"""scheduler=slurm against a real Slurm: a throw-away 4-node cluster on this host
(launch/slurm_test_cluster.sh: munge, slurmctld, 4 slurmd), jobs submitted with sbatch.

The dry run needs no Slurm. The cluster tests skip with the reason when the Slurm binaries are
not installed or this is not root (CI installs the Debian packages; see .ci/run).
"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import skip_unless_ci

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "slurm_test_cluster.sh")
# 2 model workers + 1 server + manager + 2 rollout workers + master = 7 tasks over 4 nodes
RUN = ["experiment=async-ppo-math", "eval.freq_steps=null", "model=tiny", "scheduler=slurm", "slurm.nodes=4", "slurm.poll_interval_s=0.5",
       "allocation_mode=local.d1+d2", "rollout.n_workers=2"]


def launch_cmd(out, *overrides, cache):
    return [sys.executable, "-m", "realcore.launch", *RUN, f"output_dir={out}", f"model.cache_dir={cache}", *overrides]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


def test_dry_run_prints_the_job(tmp_path, cache):
    r = subprocess.run(launch_cmd(str(tmp_path), "slurm.partition=gpu", "slurm.gpus_per_node=8", "recover_mode=auto",
                                  "slurm.setup=[module load cuda]", "slurm.requeue=true", "--dry-run", cache=cache),
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    script = r.stdout
    for line in ("#SBATCH --ntasks=7", "#SBATCH --nodes=4", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --requeue", "module load cuda", 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in script, script
    begin = next(x for x in script.splitlines() if x.startswith("srun ") and "realcore.launch.cluster begin" in x)
    assert "--ntasks=1" in begin and '--attempt "$attempt"' in begin, begin
    for kind, n in (("model_worker", 2), ("gen_server", 1), ("gserver_manager", 1), ("rollout_worker", 2), ("master", 1)):
        step = next(x for x in script.splitlines() if x.startswith(f"start {kind} srun"))
        assert f"--ntasks={n}" in step and f"--type {kind}" in step and '--attempt "$attempt"' in step, step
        assert "-m realcore.launch.cluster run " in step and " --shield-term " in step, step
        assert ("--gpus-per-task=1" in step) == (kind in ("model_worker", "gen_server")), step
        # Rollout-side workers restart in place inside their task; the trainer's failures end the job.
        assert (" --restart " in step) == (kind in ("gen_server", "gserver_manager", "rollout_worker")), step
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_requeue_needs_a_recover_mode(tmp_path, cache):
    r = subprocess.run(launch_cmd(str(tmp_path), "slurm.requeue=true", "--dry-run", cache=cache),
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "slurm.requeue" in lines[0] and "recover_mode" in lines[0], r.stderr


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [b for b in ("sbatch", "slurmctld", "slurmd", "munged") if shutil.which(b) is None]
    if missing:
        skip_unless_ci(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        skip_unless_ci("the test cluster's slurmd must run as root")
    d = str(tmp_path_factory.mktemp("slurm"))
    r = subprocess.run(["bash", SCRIPT, "up", d], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    os.environ["SLURM_CONF"] = r.stdout.strip().splitlines()[-1]
    yield d
    subprocess.run(["bash", SCRIPT, "down", d], capture_output=True, timeout=120)
    os.environ.pop("SLURM_CONF", None)


def squeue() -> str:
    return subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=30).stdout.strip()


def running_workers(out) -> dict[str, int]:
    """name -> pid of the worker processes of the run in `out` (not their task runners), from the
    command lines in /proc: the test cluster's nodes are all this host."""
    found = {}
    for d in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{d}/cmdline", "rb").read().decode().split("\0")
            state = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        module = argv[argv.index("-m") + 1:][:2] if "-m" in argv else []
        worker = module[:1] == ["realcore.launch.run_worker"]
        if not worker or f"{out}/config.json" not in argv or state == "Z":
            continue
        kind = argv[argv.index("--type") + 1]
        index = argv[argv.index("--index") + 1] if "--index" in argv else "0"
        found[kind if kind in ("master", "gserver_manager") else f"{kind}/{index}"] = int(d)
    return found


def metric_rows(out) -> int:
    try:
        return len(open(f"{out}/metrics.jsonl").read().splitlines())
    except FileNotFoundError:
        return 0


def wait_rows(out, n, proc, timeout=180):
    """Until metrics.jsonl has n rows (the run trained n steps)."""
    deadline = time.time() + timeout
    while metric_rows(out) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"not {n} steps within {timeout} s"
        time.sleep(0.2)


def n_restarts(out) -> int:
    return len(restarts(out)) if os.path.exists(f"{out}/restarts.jsonl") else 0


def wait_restarted(out, name, proc, timeout=60, after=0):
    """Until `name` has a restart among those after the first `after` (n_restarts before the fault)."""
    deadline = time.time() + timeout
    while not (os.path.exists(f"{out}/restarts.jsonl") and any(r["who"] == name for r in restarts(out)[after:])):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"{name} not restarted within {timeout} s"
        time.sleep(0.2)


def wait_running(out, names, proc, timeout=60) -> dict[str, int]:
    """running_workers(out) once every one of `names` runs (a restarted one may be starting)."""
    deadline = time.time() + timeout
    while names - set(found := running_workers(out)):
        assert proc.poll() is None or proc.returncode == 0, proc.communicate()
        assert time.time() < deadline, f"{names - set(found)} not running within {timeout} s"
        time.sleep(0.2)
    return found


def restarts(out) -> list[dict]:
    return [json.loads(x) for x in open(f"{out}/restarts.jsonl")]


def assert_ledger_exact(out, batch_size=4, eta=2):
    """No sequence trained twice, none lost, every step full, staleness within the bound."""
    from realcore.trainer.ledger import audit

    a = audit(out, batch_size=batch_size, max_head_offpolicyness=eta)
    assert a.duplicated == 0 and a.lost == 0 and a.short_steps == [] and a.over_stale == 0, a
    return a


def worker_pids(out) -> dict[str, int]:
    pids = {}
    for path in glob.glob(f"{out}/.name_resolve/**/.value", recursive=True):
        try:
            pids[os.path.relpath(os.path.dirname(path), f"{out}/.name_resolve")] = json.loads(open(path).read().partition("\n")[2])["pid"]  # after its MAC line
        except (ValueError, KeyError, TypeError):
            pass  # not a worker's address (e.g. the process-group rendezvous)
    return pids


def assert_gone(pids: dict[str, int], timeout=20):
    deadline = time.time() + timeout
    alive = lambda p: os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z"
    while time.time() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.3)
    assert not [n for n, p in pids.items() if alive(p)], f"left behind: {pids}"


def wait_for_metrics(out, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(f"{out}/metrics.jsonl") and open(f"{out}/metrics.jsonl").read().strip():
            return
        time.sleep(0.5)
    raise AssertionError("no metrics in time")


@pytest.mark.timeout(400)
def test_async_ppo_math_across_4_nodes(slurm, tmp_path, cache):
    out = str(tmp_path / "run")
    r = subprocess.run(launch_cmd(out, "trainer.total_steps=3", cache=cache), cwd=REPO, capture_output=True,
                       text=True, timeout=360)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "submitted Slurm job" in r.stdout and "step 3/3" in r.stdout  # the master's output reaches the console
    assert len(open(f"{out}/metrics.jsonl").read().splitlines()) == 3
    nodes = set()
    for log in glob.glob(f"{out}/logs/*.log"):
        for line in open(log):
            if " on node " in line:
                nodes.add(line.split(" on node ")[1].split()[0])
    assert len(nodes) >= 2, nodes  # the workers really were spread over the virtual nodes
    assert squeue() == ""
    assert open(f"{out}/slurm/status").read().strip() == "done"


@pytest.mark.timeout(400)
def test_a_script_loop_is_the_jobs_master(slurm, tmp_path, cache):
    """examples/async_grpo_loop.py under scheduler=slurm: the job's master step runs the script."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, "examples/async_grpo_loop.py", *RUN, f"output_dir={out}", f"model.cache_dir={cache}",
           "trainer.total_steps=3"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=360)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "submitted Slurm job" in r.stdout and "step 3: reward" in r.stdout  # the script's own print
    assert len(open(f"{out}/metrics.jsonl").read().splitlines()) == 3
    assert squeue() == ""
    assert open(f"{out}/slurm/status").read().strip() == "done"


@pytest.mark.timeout(400)
def test_killed_worker_cancels_the_job_and_is_named(slurm, tmp_path, cache):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(launch_cmd(out, "trainer.total_steps=1000", cache=cache), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, proc)
        pids = worker_pids(out)
        os.kill(next(p for n, p in pids.items() if n.endswith("/model_worker/1")), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "realcore: model_worker/1 died (killed by SIGKILL) (on n" in err and "; Slurm job" in err, err[-3000:]
    assert [r["action"] for r in restarts(out)] == ["give up"]  # recover_mode=disabled: no restart
    assert squeue() == ""
    assert_gone(pids)


@pytest.mark.timeout(400)
def test_interrupt_cancels_the_job(slurm, tmp_path, cache):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(launch_cmd(out, "trainer.total_steps=1000", cache=cache), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, proc)
        pids = worker_pids(out)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert squeue() == ""
    assert_gone(pids)


@pytest.mark.timeout(400)
def test_relaunch_while_the_job_lives_is_refused(slurm, tmp_path, cache):
    """The launcher SIGKILLed, its job runs on: the same command again (recover_mode=resume, so
    the folder's records are no reason to refuse) stops with one line naming the job, and leaves
    the job alone (its secret, no second job, still training). Once the job is gone, a launch may
    go ahead."""
    from realcore.launch.slurm import refuse_live_job

    out = str(tmp_path / "run")
    first = subprocess.Popen(launch_cmd(out, "trainer.total_steps=1000", cache=cache), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job = None
    try:
        wait_for_metrics(out, first)
        first.kill()
        first.wait(timeout=10)
        job = open(f"{out}/slurm/job_id").read().strip()
        assert squeue().split()[:1] == [job]
        secret, at = open(f"{out}/.secret", "rb").read(), metric_rows(out)
        r = subprocess.run(launch_cmd(out, "trainer.total_steps=1000", "recover_mode=resume", cache=cache), cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"is in use by Slurm job {job} (RUNNING)" in lines[0], r.stderr
        assert open(f"{out}/.secret", "rb").read() == secret and len(squeue().splitlines()) == 1
        deadline = time.time() + 60
        while metric_rows(out) < at + 2:  # the first job trains on
            assert time.time() < deadline, "the first job stopped training"
            time.sleep(0.2)
    finally:
        first.kill()
        if job is not None:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    deadline = time.time() + 60
    while squeue():
        assert time.time() < deadline, squeue()
        time.sleep(0.5)
    refuse_live_job(out)  # the job is over: nothing to refuse
    with open(f"{out}/slurm/job_id", "w") as f:
        f.write("987654\n")
    refuse_live_job(out)  # a job Slurm does not know (purged) is over too


# Recovery: async-ppo-math with recover_mode=auto and a recover checkpoint every 2 steps.
RECOVER = ["dataset=tiny-arith", "recover_mode=auto", "recover_delay_s=1", "trainer.recover_freq_steps=2",
           "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8",
           "rollout.max_head_offpolicyness=2"]


def launch_recover(tmp_path, cache, *overrides, env=None):
    out = str(tmp_path / "run")
    cmd = launch_cmd(out, *RECOVER, f"trial_name={tmp_path.name}", *overrides, cache=cache)
    return out, subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def break_rollout_side(out, proc):
    """Kill both rollout workers and the manager, hang (SIGSTOP) the only generation server, each
    once the run has trained 3 more steps; wait for the run to end. -> (workers before, trainer
    workers before, workers after, stdout, stderr)."""
    wait_rows(out, 3, proc)
    before = running_workers(out)
    trainer = {n: p for n, p in before.items() if n.split("/")[0] in ("master", "model_worker")}
    assert len(trainer) == 3 and len(before) == 7, before
    # The only generation server hangs (SIGSTOP): nothing trains until it is found and restarted.
    for name in ("rollout_worker/0", "gen_server/0", "gserver_manager", "rollout_worker/1"):
        os.kill(running_workers(out)[name], signal.SIGSTOP if name == "gen_server/0" else signal.SIGKILL)
        wait_restarted(out, name, proc)
        if name != "rollout_worker/1":  # training went on after it (after the last: the run finishes)
            wait_rows(out, metric_rows(out) + 3, proc)
    after = wait_running(out, set(before), proc)
    stdout, err = proc.communicate(timeout=200)
    return before, trainer, after, stdout, err


@pytest.mark.timeout(300)
def test_rollout_side_workers_restart_in_place(slurm, tmp_path, cache):
    """SIGKILL the rollout workers and the manager, SIGSTOP the generation server (a hang: its stacks
    are dumped, it is killed): each is started again inside its task while the trainer keeps its
    processes."""
    out, proc = launch_recover(tmp_path, cache, "trainer.total_steps=60", "system.heartbeat_timeout_s=10")
    try:
        before, trainer, after, stdout, err = break_rollout_side(out, proc)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + err[-3000:]
    assert {n: after.get(n) for n in trainer} == trainer  # the master and model workers were never restarted
    assert all(after[n] != before[n] for n in before if n not in trainer), (before, after)
    rows = restarts(out)
    rollout_side = {n for n in before if n not in trainer}
    assert {(r["who"], r["action"]) for r in rows} == {(n, "restart in place") for n in rollout_side}, rows
    hung = next(r for r in rows if r["who"] == "gen_server/0")
    assert hung["why"].startswith("hung (no heartbeat"), hung
    assert "most recent call first" in open(f"{out}/logs/gen_server-0.log").read()  # its stacks, dumped
    assert metric_rows(out) == 60
    print(f"restarts: {[(r['who'], r['why']) for r in rows]}; audit: {assert_ledger_exact(out)}")
    assert squeue() == ""


@pytest.mark.timeout(300)
def test_killed_model_worker_resubmits_the_job(slurm, tmp_path, cache):
    out, proc = launch_recover(tmp_path, cache, "trainer.total_steps=30")
    try:
        wait_rows(out, 3, proc)  # past the recover checkpoint of step 2
        os.kill(running_workers(out)["model_worker/1"], signal.SIGKILL)
        stdout, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + err[-3000:]
    assert "realcore: model_worker/1 died (killed by SIGKILL) (on n" in err, err[-3000:]
    assert "submitting the job again" in err, err[-3000:]
    assert stdout.count("submitted Slurm job") == 2 and "attempt 1" in stdout, stdout[-3000:]
    resumed = int(stdout.split("resuming from step ")[1].split()[0])
    assert resumed >= 2 and resumed % 2 == 0, stdout[-3000:]
    rows = restarts(out)
    assert [(r["who"], r["action"], r["attempt"]) for r in rows] == [("model_worker/1", "restart run", 0)], rows
    assert [json.loads(x)["step"] for x in open(f"{out}/metrics.jsonl")] == list(range(1, 31))
    print(f"resumed from step {resumed}; audit: {assert_ledger_exact(out)}")
    assert squeue() == ""


@pytest.mark.timeout(300)
def test_preempted_job_requeues_and_resumes(slurm, tmp_path, cache):
    """scancel --signal=TERM (as Slurm's preemption): the master checkpoints after its step and
    exits 75, the job requeues itself (slurm.requeue=true), starts again and resumes."""
    out, proc = launch_recover(tmp_path, cache, "trainer.total_steps=30", "slurm.requeue=true")
    try:
        wait_rows(out, 3, proc)
        job = squeue().split()[0]
        at = metric_rows(out)
        r = subprocess.run(["scancel", "--signal=TERM", job], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        stdout, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + err[-3000:]
    assert stdout.count("submitted Slurm job") == 1, stdout[-3000:]  # the same job, requeued by Slurm
    assert "preempted after step" in stdout and "Slurm started job" in err, stdout[-3000:] + err[-2000:]
    resumed = int(stdout.split("resuming from step ")[1].split()[0])
    assert resumed >= at, (resumed, at)  # the preemption's own checkpoint, not an older one
    assert [(r["who"], r["action"]) for r in restarts(out)] == [("job", "resume after requeue")]
    assert [json.loads(x)["step"] for x in open(f"{out}/metrics.jsonl")] == list(range(1, 31))
    print(f"preempted at step {resumed}, requeued, resumed; audit: {assert_ledger_exact(out)}")
    assert squeue() == ""


@pytest.mark.timeout(300)
def test_sigterm_to_the_launcher_preempts_the_job(slurm, tmp_path, cache):
    """SIGTERM to the launcher: the job is preempted (a recover checkpoint, no requeue) and the
    launcher exits 75; the same command continues the run."""
    out, proc = launch_recover(tmp_path, cache, "trainer.total_steps=1000", "slurm.requeue=true")
    try:
        wait_rows(out, 3, proc)
        pids = running_workers(out)
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, stdout[-2000:] + err[-3000:]
    assert "preempted; Slurm job" in err and "exit code 75" in err, err[-3000:]
    step = int(stdout.split("preempted after step ")[1].split(":")[0])
    assert os.path.exists(f"{out}/recover/step_{step}") and metric_rows(out) == step
    assert open(f"{out}/slurm/status").read().strip() == "preempted"
    assert squeue() == ""
    assert_gone(pids)


@pytest.mark.timeout(300)
def test_hung_model_worker_is_named_with_its_stacks(slurm, tmp_path, cache):
    """SIGSTOP a model worker: its peers lose it, the job ends, and its task runner dumps its stacks
    into its log and names it (recover_mode=disabled: exit 1)."""
    out = str(tmp_path / "run")
    proc = subprocess.Popen(launch_cmd(out, "trainer.total_steps=1000", "system.heartbeat_timeout_s=10",
                                       f"trial_name={tmp_path.name}", cache=cache),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_rows(out, 2, proc)
        pids = running_workers(out)
        os.kill(pids["model_worker/1"], signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "realcore: model_worker/1 hung (no heartbeat for" in err, err[-3000:]
    assert "most recent call first" in open(f"{out}/logs/model_worker-1.log").read()
    print(next(line for line in err.splitlines() if "hung" in line))
    assert squeue() == ""
    assert_gone(pids)


# SGLang servers under Slurm, through the real launch path: each server task starts the engine's
# command line on its node. The test switch REALCORE_TEST_ENGINE_BUILTIN=1 makes that command
# `python -m realcore.serve` (the built-in server, which takes SGLang's flags): no SGLang here.
def engine_env() -> dict:
    return {**os.environ, "REALCORE_TEST_ENGINE_BUILTIN": "1"}


def engine_pids(out) -> dict[int, int]:
    """server index -> pid of the engine process (the stand-in for SGLang) of the run in `out`."""
    from test_cluster_engines import _engine_pids

    found = {}
    for pid in _engine_pids(out):
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
        found[int(next(a for a in argv if a.startswith(f"{out}/.engine/")).split("gen_server-")[1].split("/")[0])] = pid
    return found


def _ready(out, i) -> bool:
    """Server i's latest start reached "ready" (a kill before that is a failed start, not a death)."""
    try:
        lines = [line for line in open(f"{out}/logs/gen_server-{i}.log") if f"server {i} " in line]
    except FileNotFoundError:
        return False
    starts = [n for n, line in enumerate(lines) if "starting " in line]
    return bool(starts) and any("ready at" in line for line in lines[starts[-1]:])


def wait_engines(out, indices, proc, timeout=90) -> dict[int, int]:
    """engine_pids(out) once every server in `indices` has its engine running and ready."""
    deadline = time.time() + timeout
    while True:
        found = engine_pids(out)
        missing = indices - {i for i in found if _ready(out, i)}
        if not missing:
            return found
        assert proc.poll() is None and time.time() < deadline, f"engines {missing} not ready"
        time.sleep(0.3)


def assert_engines_gone(out, timeout=20):
    deadline = time.time() + timeout
    while engine_pids(out) and time.time() < deadline:
        time.sleep(0.3)
    assert engine_pids(out) == {}, "an engine outlived its task"


@pytest.mark.timeout(300)
def test_sglang_servers_serve_an_async_run_and_restart_in_their_task(slurm, tmp_path, cache):
    """Two SGLang server tasks (the real launch path, the built-in server standing in) serve an
    async run; SIGKILL the engine of server 0: its task starts a new one (new port, published), the
    manager catches it up, the run finishes with every step trained once, and no engine is left."""
    out, proc = launch_recover(tmp_path, cache, "allocation_mode=sglang.d2+d2", "trainer.total_steps=150",
                               "slurm.gpus_per_node=0", env=engine_env())
    try:
        wait_rows(out, 3, proc)
        first = wait_engines(out, {0, 1}, proc)  # a server may still be starting after 3 steps
        before = n_restarts(out)  # a server that missed its start-up deadline on a busy machine was restarted already
        os.kill(first[0], signal.SIGKILL)
        wait_restarted(out, "gen_server/0", proc, after=before)
        deadline = time.time() + 60
        while "server 0 restarted at" not in open(f"{out}/logs/gserver_manager-0.log").read():
            assert proc.poll() is None and time.time() < deadline, "the manager never saw server 0 come back"
            time.sleep(0.3)
        again = engine_pids(out)
        wait_rows(out, metric_rows(out) + 3, proc)
        stdout, err = proc.communicate(timeout=200)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + err[-3000:]
    assert again[0] != first[0] and again[1] == first[1], (first, again)
    rows = restarts(out)[before:]
    assert [(r["who"], r["action"], r["why"]) for r in rows] == [("gen_server/0", "restart in place", "died (exit code 1)")], rows
    assert "exited on its own" in open(f"{out}/logs/gen_server-0.log").read()
    for i in range(2):
        assert f"sglang server {i} ready at http://" in open(f"{out}/logs/gen_server-{i}.log").read()
    assert metric_rows(out) == 150
    print(f"audit: {assert_ledger_exact(out)}")
    assert squeue() == ""
    assert_engines_gone(out)
