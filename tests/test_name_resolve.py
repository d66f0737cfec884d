"""Name resolution, one suite run against every backend: the filesystem, and real Redis and etcd
servers started here on loopback (skipped, with the reason, where the server binary is absent)."""

import multiprocessing as mp
import shutil
import socket
import subprocess
import threading
import time
import uuid

import pytest

from realcore.api.config import NameResolveConfig
from realcore.system.name_resolve import KeyExistsError, make_name_resolver, scoped_key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(argv: list[str], address: str, backend: str, log_path):
    """Start a server, wait until a resolver connects (deadline), yield, stop it (no leftovers)."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            make_name_resolver(NameResolveConfig(type=backend, address=address, timeout_s=1))
            break
        except ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()[-2000:]
            time.sleep(0.1)
    try:
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    pytest.importorskip("redis", reason="pip install -e '.[redis]'")
    d = tmp_path_factory.mktemp("redis")
    port = _free_port()
    yield from _serve(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                       "--dir", str(d)], f"127.0.0.1:{port}", "redis", d / "log")


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    pytest.importorskip("pyetcd", reason="pip install -e '.[etcd]'")
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
    return make_name_resolver(cfg)


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


N_RACE_KEYS = 50


def _racer(cfg_dict, name, start, out):
    nr = make_name_resolver(NameResolveConfig(**cfg_dict))
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
    nr = make_name_resolver(cfg)
    for i in range(N_RACE_KEYS):
        winners = [n for n, won in results.items() if i in won]
        assert len(winners) == 1, f"key k{i}: winners {winners}"
        assert nr.get(f"race/t/k{i}") == winners[0]


def test_server_backends_fail_fast_naming_the_address():
    for backend in ("redis", "etcd"):
        port = _free_port()  # nothing listens there
        t0 = time.monotonic()
        try:
            make_name_resolver(NameResolveConfig(type=backend, address=f"127.0.0.1:{port}", timeout_s=1))
        except ImportError:
            continue  # client not installed: covered by the skip of the server fixtures
        except ConnectionError as e:
            assert f"name_resolve({backend}): cannot reach 127.0.0.1:{port}" in str(e)
        else:
            raise AssertionError(f"{backend}: no error for a dead address")
        assert time.monotonic() - t0 < 10


def test_bad_address_is_one_clear_error():
    with pytest.raises(ValueError, match="address must be host:port"):
        make_name_resolver(NameResolveConfig(type="redis", address="localhost"))
