"""Per-process set-up (realcore/launch/process.py): no child of a worker outlives it.

A worker SIGKILLed while a library's forked helper runs (megatron-core's checkpoint writer forks
one per bucket) must not leave that helper behind: here a real worker process forks through
multiprocessing's fork context, as megatron-core does, and is SIGKILLed."""

import os
import signal
import subprocess
import sys
import time

import psutil

WORKER = """
import multiprocessing as mp, sys, time
from realcore.launch.process import setup_worker_process
setup_worker_process("rc-test", 1)
child = mp.get_context("fork").Process(target=time.sleep, args=(120,))
child.start()
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_forked_helper_dies_with_its_killed_worker():
    proc = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert psutil.pid_exists(child)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the forked child outlived its SIGKILLed worker")
        time.sleep(0.1)


EXITING = """
import atexit, concurrent.futures, sys, threading, time
from realcore.launch.process import run_and_exit

EXECUTOR = concurrent.futures.ThreadPoolExecutor(1)  # still referenced at exit, as an event loop's default one

class Leak:  # unreachable at exit (a cycle): its finalizer must still run, as it would in a teardown
    def __del__(self):
        print("finalized", flush=True)

def main():
    leak = Leak()
    leak.me = leak
    atexit.register(lambda: print("atexit", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    EXECUTOR.submit(time.sleep, 0).result()  # its idle worker thread must not hold the exit
    sys.stdout.write("buffered")  # no newline, no flush: the exit flushes it
    if sys.argv[1] == "message":
        sys.exit("a message")
    return int(sys.argv[1])

run_and_exit(main)
"""


def test_run_and_exit_keeps_what_a_normal_exit_does():
    """Workers and the launcher exit through run_and_exit (no module teardown): the exit code,
    a non-daemon thread's end, atexit handlers, finalizers of unreachable objects and buffered
    output all still happen, in Python's order; an executor's idle threads do not hold it."""
    for arg, code in (("0", 0), ("3", 3), ("message", 1)):
        r = subprocess.run([sys.executable, "-c", EXITING, arg], capture_output=True, text=True, timeout=30)
        assert r.returncode == code, r
        assert r.stdout.splitlines() == ["bufferedthread done", "atexit", "finalized"], r.stdout
        assert r.stderr == ("a message\n" if arg == "message" else ""), r.stderr
