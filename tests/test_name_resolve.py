"""Name resolution, one suite run against every backend: the filesystem, and real Redis and etcd
servers started here on loopback (skipped, with the reason, where the server binary is absent).
Every entry carries the run's MAC: forged or moved entries read as absent and are counted."""

import multiprocessing as mp
import shutil
import socket
import subprocess
import threading
import time
import uuid

import pytest
from conftest import import_unless_ci, skip_unless_ci, stop_daemon

from realcore.api.config import NameResolveConfig
from realcore.transport import drops
from realcore.transport.name_resolve import KeyExistsError, NoSecretError, make_name_resolver, scoped_key

SECRET = b"s" * 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(argv: list[str], address: str, backend: str, log_path):
    """Start a server, wait until a resolver connects (deadline), yield, stop it (no leftovers)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:  # also when the wait fails: a server that never answered must not outlive the test
        deadline = time.monotonic() + 30
        while True:
            try:
                make_name_resolver(NameResolveConfig(type=backend, address=address, timeout_s=1))
                break
            except ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()[-2000:]
                time.sleep(0.1)
        yield address
    finally:
        stop_daemon(proc)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        skip_unless_ci("redis-server is not installed (apt-get install redis-server)")
    import_unless_ci("redis", "pip install -e '.[redis]'")
    d = tmp_path_factory.mktemp("redis")
    port = _free_port()
    yield from _serve(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                       "--dir", str(d)], f"127.0.0.1:{port}", "redis", d / "log")


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    if shutil.which("etcd") is None:
        skip_unless_ci("etcd is not installed (apt-get install etcd-server)")
    import_unless_ci("pyetcd", "pip install -e '.[etcd]'")
    d = tmp_path_factory.mktemp("etcd")
    client, peer = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    yield from _serve(["etcd", "--data-dir", str(d / "data"), "--listen-client-urls", client, "--advertise-client-urls",
                       client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                       "--initial-cluster", f"default={peer}"], client.removeprefix("http://"), "etcd", d / "log")


@pytest.fixture(params=["fs", "redis", "etcd"])
def cfg(request, tmp_path):
    """A config (not a resolver): what a child process receives, so each backend can be raced
    across processes. Server backends get a fresh namespace per test."""
    if request.param == "fs":
        return NameResolveConfig(type="fs", root=str(tmp_path / "nr"))
    address = request.getfixturevalue(f"{request.param}_server")
    return NameResolveConfig(type=request.param, address=address, namespace=f"t-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def nr(cfg):
    return make_name_resolver(cfg, SECRET)


def test_put_get_replace_delete(nr):
    k = scoped_key("exp", "t0", "worker", "0")
    assert k == "exp/t0/worker/0"
    with pytest.raises(KeyError, match=f"name_resolve\\({nr.backend_name}\\): no key '{k}'"):
        nr.get(k)
    nr.put(k, "tcp://127.0.0.1:5000")
    assert nr.get(k) == "tcp://127.0.0.1:5000"
    with pytest.raises(KeyExistsError, match=k):
        nr.put(k, "other")
    nr.put(k, "tcp://127.0.0.1:5001", replace=True)
    assert nr.get(k) == "tcp://127.0.0.1:5001"
    nr.put(k + "/sub", "nested")  # a key can also be a prefix of another key
    assert nr.get(k) == "tcp://127.0.0.1:5001" and nr.get(k + "/sub") == "nested"
    nr.delete(k)
    with pytest.raises(KeyError):
        nr.get(k)
    with pytest.raises(KeyError):
        nr.delete(k)
    assert nr.get(k + "/sub") == "nested"


@pytest.mark.parametrize("bad", ["", "/a", "a/", "a//b", "a/../b", "..", "a/.value", "a\0b"])
def test_bad_keys(nr, bad):
    with pytest.raises(ValueError):
        nr.put(bad, "x")


def test_scoped_key_validation():
    for exp, trial in [("a/b", "t"), ("e", ".."), ("", "t"), ("e", "t/x")]:
        with pytest.raises(ValueError):
            scoped_key(exp, trial, "x")


def test_wait(nr):
    k = scoped_key("exp", "t0", "late")
    timer = threading.Timer(0.2, nr.put, args=(k, "here"))
    t0 = time.monotonic()
    timer.start()
    try:
        assert nr.wait(k, timeout_s=10) == "here"
    finally:
        timer.cancel()
    assert 0.15 < time.monotonic() - t0 < 5


def test_wait_timeout_names_key_and_backend(nr):
    k = scoped_key("exp", "t0", "never")
    t0 = time.monotonic()
    msg = f"name_resolve\\({nr.backend_name}\\): gave up waiting for key '{k}' after 0.2 s"
    with pytest.raises(TimeoutError, match=msg):
        nr.wait(k, timeout_s=0.2, poll_s=0.05)
    assert time.monotonic() - t0 < 2


def test_find_and_clear_scoping(nr):
    for trial in ("A", "B"):
        for i in range(3):
            nr.put(scoped_key("exp", trial, "w", str(i)), f"{trial}{i}")
    nr.put(scoped_key("exp", "AA", "w", "0"), "not under A")
    assert nr.find("exp/A") == {f"exp/A/w/{i}": f"A{i}" for i in range(3)}
    assert nr.find("exp/A/w/1") == {"exp/A/w/1": "A1"}
    assert nr.find("exp/C") == {}
    nr.clear("exp/A")
    nr.clear("exp/A")  # clearing nothing is fine
    assert nr.find("exp/A") == {}
    assert nr.find("exp/B") == {f"exp/B/w/{i}": f"B{i}" for i in range(3)}
    assert nr.get("exp/AA/w/0") == "not under A"


def test_two_runs_are_isolated(nr):
    """Runs differing in experiment or trial share a resolver but never see each other's keys."""
    runs = [("exp", "t0"), ("exp", "t1"), ("exp2", "t0"), ("exp2", "t00")]
    for exp, trial in runs:
        for part in ("master", "worker/0"):
            nr.put(scoped_key(exp, trial, *part.split("/")), f"{exp}.{trial}.{part}")
    for exp, trial in runs:
        scope = scoped_key(exp, trial)
        assert nr.find(scope) == {f"{scope}/{p}": f"{exp}.{trial}.{p}" for p in ("master", "worker/0")}
    nr.clear(scoped_key("exp2", "t0"))  # a run starting again clears only its own scope
    assert nr.find("exp2/t0") == {}
    for exp, trial in [r for r in runs if r != ("exp2", "t0")]:
        assert len(nr.find(scoped_key(exp, trial))) == 2, (exp, trial)
    nr.clear("exp")
    assert nr.find("exp") == {} and len(nr.find("exp2")) == 2


def _run_cfg(output_dir: str):
    from realcore.api.config import ExperimentConfig, MFCConfig

    return ExperimentConfig(experiment_name="exp", trial_name="trial0", output_dir=output_dir,
                            mfcs=[MFCConfig(name="n", type="t")])


def test_one_trial_in_two_output_dirs_keeps_two_scopes(nr, tmp_path, monkeypatch):
    """The default trial0 launched into two output_dirs: two runs, each with its own keys; a run's
    (re)start clears its own scope only. The same output_dir, relative or absolute, is one run."""
    from realcore.transport import keys

    a, b = _run_cfg(str(tmp_path / "a")), _run_cfg(str(tmp_path / "b"))
    assert keys.scope(a) != keys.scope(b)
    for cfg in (a, b):
        assert keys.scope(cfg).startswith("exp/trial0/run-")
        for key in (keys.model_worker(cfg, 0), keys.manager(cfg), keys.gen_server(cfg, 1), keys.dist_init(cfg)):
            assert key.startswith(keys.scope(cfg) + "/")
            nr.put(key, cfg.output_dir)
    nr.clear(keys.scope(a))  # run a starts again
    assert nr.find(keys.scope(a)) == {}
    assert set(nr.find(keys.scope(b)).values()) == {b.output_dir} and len(nr.find(keys.scope(b))) == 4
    assert nr.get(keys.model_worker(b, 0)) == b.output_dir
    monkeypatch.chdir(tmp_path)
    assert keys.scope(_run_cfg("a")) == keys.scope(a) and keys.scope(_run_cfg("a/")) == keys.scope(a)


N_RACE_KEYS = 50


def _racer(cfg_dict, name, start, out):
    nr = make_name_resolver(NameResolveConfig(**cfg_dict), SECRET)
    start.wait()
    won = []
    for i in range(N_RACE_KEYS):
        try:
            nr.put(f"race/t/k{i}", name)
            won.append(i)
        except KeyExistsError:
            pass
    out.put((name, won))


def test_two_processes_race_put(cfg):
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(cfg.model_dump(), n, start, out)) for n in ("p0", "p1")]
    for p in procs:
        p.start()
    start.set()
    results = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    nr = make_name_resolver(cfg, SECRET)
    for i in range(N_RACE_KEYS):
        winners = [n for n, won in results.items() if i in won]
        assert len(winners) == 1, f"key k{i}: winners {winners}"
        assert nr.get(f"race/t/k{i}") == winners[0]


@pytest.mark.parametrize("backend,module", [("redis", "redis"), ("etcd", "pyetcd")])
def test_server_backends_fail_fast_naming_the_address(backend, module):
    import_unless_ci(module, f"pip install -e '.[{backend}]'")
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"name_resolve\\({backend}\\): cannot reach 127.0.0.1:{port}"):
        make_name_resolver(NameResolveConfig(type=backend, address=f"127.0.0.1:{port}", timeout_s=1))
    assert time.monotonic() - t0 < 2  # refused at once: no client-side retries


def test_bad_address_is_one_clear_error():
    with pytest.raises(ValueError, match="address must be host:port"):
        make_name_resolver(NameResolveConfig(type="redis", address="localhost"))


def _refusals() -> int:
    return sum(n for k, n in drops.snapshot().items() if k.startswith("name_resolve/"))


def test_forged_moved_and_foreign_entries_read_as_absent(nr, cfg):
    """Whoever can write to the store but lacks the run's secret cannot plant an address: an
    unsigned value, a signed value moved to another key, one signed with another run's secret all
    read as absent (get, find, wait), each counted once on socket name_resolve."""
    k, other = scoped_key("exp", "t0", "w", "0"), scoped_key("exp", "t0", "w", "1")
    before = _refusals()
    tag = uuid.uuid4().hex  # values of this backend's own: a process counts each forged entry once
    nr._put(k, f"tcp://attacker:1/{tag}", replace=True)  # what a writer without the secret can do
    with pytest.raises(KeyError, match=k):
        nr.get(k)
    with pytest.raises(TimeoutError):
        nr.wait(k, timeout_s=0.2)
    assert nr.find("exp/t0") == {}
    assert _refusals() == before + 1  # one forged entry, polled many times: counted once
    nr.put(other, f"tcp://good:2/{tag}")
    nr._put(k, nr._get(other), replace=True)  # a valid entry replayed under another key
    assert nr.find("exp/t0") == {other: f"tcp://good:2/{tag}"}
    make_name_resolver(cfg, b"x" * 32).put(k, f"tcp://earlier-run:3/{tag}", replace=True)
    with pytest.raises(KeyError):
        nr.get(k)
    assert _refusals() == before + 3
    nr.put(k, "tcp://good:1", replace=True)  # the run's own entry replaces it
    assert nr.get(k) == "tcp://good:1"


def test_resolver_without_secret_only_clears(cfg):
    """The launcher clears a run's keys before the run's secret exists; nothing else may read or
    write without it (a run process that forgot it fails at once, not with a silent unsigned store)."""
    bare = make_name_resolver(cfg)
    with pytest.raises(NoSecretError):
        bare.put("exp/t0/x", "v")
    with pytest.raises(NoSecretError):
        bare.wait("exp/t0/x", timeout_s=30)
    make_name_resolver(cfg, SECRET).put("exp/t0/x", "v")
    bare.clear("exp/t0")
    assert make_name_resolver(cfg, SECRET).find("exp/t0") == {}
