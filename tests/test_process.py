"""Per-process set-up (realcore/system/process.py): no child of a worker outlives it.

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
from realcore.system.process import setup_worker_process
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
