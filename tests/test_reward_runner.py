"""RewardRunner with real spawned children: values, raises, hangs, crashes, bad values, concurrency, close."""

import asyncio
import logging
import sys
import textwrap
import threading
import time

import psutil
import pytest

from realcore.workflows.reward_runner import RewardCall, RewardOutcome, RewardRunner

# One reward whose behaviour the response selects, so one runner (one child start-up) serves most tests.
REWARDS = textwrap.dedent('''
    import math, os, subprocess, time
    from realcore.api.registry import register_reward

    @register_reward("rr_test")
    def rr_test(prompt, completion, prompt_ids, completion_ids, *, answer, **data):
        response = completion
        kind, _, arg = response.partition(":")
        if kind == "len":
            return float(len(arg))
        if kind == "raise":
            return 1 / 0
        if kind == "hang":  # answer: a file to write our pid (and a grandchild's) into
            pids = [os.getpid()]
            if arg == "tree":
                pids.append(subprocess.Popen(["sleep", "1000"]).pid)
            if arg == "setsid":  # new sessions: one a child, one orphaned by a double fork
                pids.append(subprocess.Popen(["setsid", "sleep", "1000"]).pid)
                out = subprocess.run(["sh", "-c", "setsid sleep 1001 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
                pids.append(int(out.stdout))
            with open(answer, "w") as f:
                f.write(" ".join(map(str, pids)))
            time.sleep(1000)
        if kind == "exit":
            os._exit(3)
        if kind == "nan":
            return math.nan
        if kind == "inf":
            return math.inf
        if kind == "str":
            return "1.0"
        if kind == "sleep":  # "sleep:i": return i after a short sleep
            time.sleep(0.02)
            return float(arg)
        if kind == "pid":
            return float(os.getpid())
        if kind == "args":  # every argument reaches the reward
            return float(len(prompt) + sum(prompt_ids) + sum(completion_ids) + int(data["extra"]))
        raise AssertionError(response)

    @register_reward("rr_async")
    async def rr_async(prompt, completion, prompt_ids, completion_ids, **data):
        import asyncio
        await asyncio.sleep(0.01)
        return float(len(completion))
''')
MODULE = "reward_runner_test_rewards"
TIMEOUT_S = 1.0
pytestmark = pytest.mark.timeout(120)


def call(response: str, answer: str) -> RewardCall:
    return RewardCall("", response, [], [], {"answer": answer})


def calls(pairs) -> list[RewardCall]:
    return [call(r, a) for r, a in pairs]  # a runner bug must fail here, not hang the suite


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    d = tmp_path_factory.mktemp("rewards")
    (d / f"{MODULE}.py").write_text(REWARDS)
    sys.path.insert(0, str(d))  # spawned children inherit sys.path
    yield [MODULE]
    sys.path.remove(str(d))


@pytest.fixture(scope="module")
def runner(modules):
    # Built on a thread that then ends: PDEATHSIG follows the creating *thread*, so the runner must start
    # its children from its own thread for them to survive this.
    box = []
    t = threading.Thread(target=lambda: box.append(RewardRunner("rr_test", modules, timeout_s=TIMEOUT_S, n_procs=2)))
    t.start()
    t.join()
    yield box[0]
    box[0].close()


def gone(pid: int) -> bool:
    try:  # a killed grandchild may linger as a zombie until init reaps it
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_all_ready(runner):
    """Until both children answer (a replacement takes seconds to import torch)."""
    deadline = time.monotonic() + 60
    while len({o.reward for o in runner.score(calls([("pid:", "")] * 8))}) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_value(runner):
    assert runner.score(calls([("len:abc", ""), ("len:", ""), ("len:hello", "")])) == [
        RewardOutcome(3.0, None), RewardOutcome(0.0, None), RewardOutcome(5.0, None)]  # fmt: skip
    assert asyncio.run(runner.ascore(call("len:ab", ""))) == RewardOutcome(2.0, None)


def test_raise_is_error_and_logged_once_per_storm(runner, caplog):
    # First test to fail a call: the log is rate-limited per kind, so later errors may be folded in.
    with caplog.at_level(logging.WARNING, logger="realcore.reward_runner"):
        out = runner.score(calls([("raise:", "")] * 20))
    assert out == [RewardOutcome(0.0, "error")] * 20
    assert len(caplog.records) == 1 and "ZeroDivisionError: division by zero" in caplog.records[0].getMessage()
    assert runner.score(calls([("len:ab", "")])) == [RewardOutcome(2.0, None)]


@pytest.mark.parametrize("kind", ["nan", "inf", "str"])
def test_bad_value_is_error(runner, kind):
    assert runner.score(calls([(f"{kind}:", "")])) == [RewardOutcome(0.0, "error")]


def test_timeout_kills_child_and_its_processes(runner, tmp_path):
    pid_file = tmp_path / "pids"
    t = time.monotonic()
    out = runner.score(calls([("hang:tree", str(pid_file))]))
    elapsed = time.monotonic() - t
    assert out == [RewardOutcome(0.0, "timeout")]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1.0
    child, grandchild = map(int, pid_file.read_text().split())
    assert child not in runner.pids and gone(child) and gone(grandchild)
    assert runner.score(calls([("len:abc", "")])) == [RewardOutcome(3.0, None)]


def test_timeout_kills_what_the_reward_started_in_new_sessions(runner, tmp_path):
    """A reward that starts processes with setsid (leaving its group), one of them a double fork
    (orphaned at once), then times out: none of them outlives the call."""
    pid_file = tmp_path / "pids"
    assert runner.score(calls([("hang:setsid", str(pid_file))])) == [RewardOutcome(0.0, "timeout")]
    child, *started = map(int, pid_file.read_text().split())
    deadline = time.monotonic() + 5  # the last kills land after the reply
    while not all(gone(p) for p in [child, *started]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(started) == 2 and all(gone(p) for p in [child, *started])
    assert runner.score(calls([("len:abc", "")])) == [RewardOutcome(3.0, None)]


def test_child_exit_is_error_and_replaced(runner):
    assert runner.score(calls([("exit:", "")])) == [RewardOutcome(0.0, "error")]
    assert runner.score(calls([("len:abcd", "")])) == [RewardOutcome(4.0, None)]
    assert len(runner.pids) == 2


def test_concurrent_ascore_with_one_hanging(runner, tmp_path):
    wait_all_ready(runner)

    async def main():
        hang = runner.ascore(call("hang:", str(tmp_path / "pid")))
        return await asyncio.gather(hang, *(runner.ascore(call(f"sleep:{i}", "")) for i in range(20)))

    t = time.monotonic()
    out = asyncio.run(main())
    assert time.monotonic() - t < TIMEOUT_S + 1.0  # the other child served the rest meanwhile
    assert out == [RewardOutcome(0.0, "timeout")] + [RewardOutcome(float(i), None) for i in range(20)]
    assert gone(int((tmp_path / "pid").read_text()))


def test_per_call_overhead(runner):
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        runner.score(calls([("len:x", "")]))
    mean_ms = (time.perf_counter() - t) / n * 1e3
    print(f"reward runner: {mean_ms:.3f} ms per call")
    assert mean_ms < 20  # a few hundred microseconds here; this only catches a regression by orders


def test_unknown_reward_or_module_is_value_error(modules):
    with pytest.raises(ValueError, match="unknown reward 'no_such_reward'"):
        RewardRunner("no_such_reward", modules, timeout_s=1.0)
    with pytest.raises(ValueError, match="cannot import 'realcore_no_such_module'"):
        RewardRunner("rr_test", ["realcore_no_such_module"], timeout_s=1.0)


def test_close_leaves_nothing(runner, tmp_path):  # last test of the shared runner
    pids = runner.pids
    assert len(pids) == 2
    threads = threading.active_count()

    async def main():  # a call in flight at close() fails rather than waits forever
        task = asyncio.ensure_future(runner.ascore(call("hang:setsid", str(tmp_path / "pid"))))
        deadline = time.monotonic() + 5
        while len((tmp_path / "pid").read_text().split() if (tmp_path / "pid").exists() else ()) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        runner.close()
        with pytest.raises(RuntimeError, match="closed"):
            await task

    asyncio.run(main())
    started = [int(p) for p in (tmp_path / "pid").read_text().split()[1:]]  # in sessions of their own
    assert len(started) == 2 and all(gone(p) for p in pids + started) and threading.active_count() == threads - 1
    with pytest.raises(RuntimeError, match="closed"):
        runner.score(calls([("len:a", "")]))


PARENT = r"""
import time
from realcore.workflows.reward_runner import RewardCall, RewardRunner

if __name__ == "__main__":
    r = RewardRunner("math", ["realcore.data"], timeout_s=30.0)
    out = r.score([RewardCall("", r"so \boxed{\sqrt{4}}", [], [], {"answer": "2"})])  # symbolic: the child starts math_verify's sympy worker
    print(out[0].reward, *r.pids, flush=True)
    time.sleep(1000)
"""


def test_children_die_with_parent(tmp_path):
    import subprocess

    (tmp_path / "parent.py").write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], stdout=subprocess.PIPE, text=True)
    try:
        reward, *pids = proc.stdout.readline().split()
        assert float(reward) == 1.0 and len(pids) == 1
        tree = [int(pids[0])] + [c.pid for c in psutil.Process(int(pids[0])).children(recursive=True)]
        assert len(tree) >= 2  # the reward child and its sympy worker
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in tree)


def test_reward_gets_every_argument_and_may_be_async(modules):
    r = RewardRunner("rr_test", modules, timeout_s=TIMEOUT_S)
    try:
        out = r.score([RewardCall("abc", "args:", [1, 2], [3], {"answer": "", "extra": 10})])
        assert out == [RewardOutcome(3 + 3 + 3 + 10, None)]
    finally:
        r.close()
    r = RewardRunner("rr_async", modules, timeout_s=TIMEOUT_S)
    try:
        assert r.score(calls([("hello", ""), ("", "")])) == [RewardOutcome(5.0, None), RewardOutcome(0.0, None)]
    finally:
        r.close()
