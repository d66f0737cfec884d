"""Smoke test of the master scale simulation: `bench/master_scale.py --quick` prints its table."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(240)
def test_master_scale_quick():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "master_scale.py"), "--quick"], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| workers")]
    assert [r[0] for r in rows] == ["4", "16"], proc.stdout
    for r in rows:
        assert float(r[4]) > 0 and float(r[11]) > 0, r  # step time, peak RSS
        assert r[-2] == "0", r  # step 1's samples were dropped by the workers before step 2's fetch
        assert r[-1] == "0", r  # nothing left in the master's buffer, nor on the workers, after the run
    # The master sends one message per node (relay group 8: 1 relay for 4 workers; 2 for 16, the
    # second's messages passed on by the first: relay fanout 8) for each of a step's 3 requests, and
    # the last step's CLEAR: 3.5 per step over 2 steps.
    assert [(r[1], r[2], r[3]) for r in rows] == [("8", "8", "3.5"), ("8", "8", "3.5")], proc.stdout
    # Per step and worker: one FETCH, one RUN_MFC for actor_gen and one for ref_inf with actor_train
    # chained to it; the release rides on the next step's requests (the last step's: one CLEAR each).
    for n in (4, 16):
        line = next(line for line in proc.stdout.splitlines() if line.startswith(f"N={n},"))
        assert re.search(rf"\(CLEAR {n / 2:g}, FETCH {n}, RUN_MFC {2 * n}\)", line), line
