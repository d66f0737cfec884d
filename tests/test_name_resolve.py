"""Name resolution, run against every backend in BACKENDS (Redis/etcd join the list later)."""

import multiprocessing as mp
import threading
import time

import pytest

from realcore.api.config import NameResolveConfig
from realcore.system.name_resolve import KeyExistsError, make_name_resolver, scoped_key

# Each entry: backend name -> function(tmp_path) -> NameResolveConfig. The config (not the
# resolver) is what a child process receives, so every backend can be raced across processes.
BACKENDS = {
    "fs": lambda tmp_path: NameResolveConfig(type="fs", root=str(tmp_path / "nr")),
}


@pytest.fixture(params=sorted(BACKENDS))
def cfg(request, tmp_path):
    return BACKENDS[request.param](tmp_path)


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
