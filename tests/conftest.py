import os
import subprocess

# One thread per process: two are pathologically slow on these 2-core CPUs (see README).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import time  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# Fast unit tests first, then the multi-process end-to-end runs (CI's order: a broken unit shows
# in minutes, not after half an hour of end-to-end runs).
END_TO_END = ("test_e2e_", "test_bad_input", "test_fuzz", "test_recovery", "test_slurm", "test_ray", "test_megatron_engine", "test_megatron_recover",
              "test_bench_", "test_user_extension", "test_wandb_logging", "test_controller")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(n=1): needs n CUDA GPUs; skips where fewer are visible, saying how many it "
                            "needs (bench/gpu_check.py runs every one of them: pytest -m gpu)")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.module.__name__.startswith(END_TO_END))
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        need = (marker.args[0] if marker.args else marker.kwargs.get("n", 1)) if marker else 0
        if need > have:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s); this machine has {have}"))


def skip_unless_ci(reason: str) -> None:
    """Skip a test whose daemon or package is missing here; under CI (REALCORE_CI=1, set by .ci/run,
    which installs them all) a missing one is a failure, so a broken install cannot pass as skips."""
    if os.environ.get("REALCORE_CI") == "1":
        pytest.fail(f"CI installs this, but: {reason}")
    pytest.skip(reason, allow_module_level=True)


def stop_daemon(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End a daemon a test started (redis, etcd): SIGTERM, then SIGKILL after `grace_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def import_unless_ci(module: str, reason: str):
    """`pytest.importorskip` for a package CI installs: the module, or a skip here and a failure
    under CI (a module-level call fails the file's collection there)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        skip_unless_ci(f"{reason} ({e})")


def _processes_of(path: str) -> list:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and path in " ".join(p.info["cmdline"] or ()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """After a test that used tmp_path, no process whose command line names that folder (a run's
    workers, servers and their forked helpers all do) may still live: leftovers are killed and
    the test fails, naming them."""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is None:
        return
    deadline = time.monotonic() + 20  # a run's processes may still be on their way out
    while (left := _processes_of(str(tmp))) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        names = [" ".join(p.info["cmdline"])[:160] for p in left]
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        pytest.fail(f"left behind by the test: {names}")
