"""Smoke tests of the benchmarks: `--quick` runs finish and print their tables."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table_rows(stdout: str, *, skip: str | None = None, key=lambda first: first) -> dict[str, list[str]]:
    """A benchmark's markdown table: key(first cell) -> the other cells (rows starting with `skip` left out)."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("| ") and not (skip and line.startswith(skip)):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[key(cells[0])] = cells[1:]
    return rows


@pytest.mark.timeout(120)
def test_zmq_queue_rss_bench_quick():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "zmq_queue_rss.py"), "--peers", "4", "--rounds", "50"],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:3] for line in proc.stdout.splitlines() if line.startswith("| ") and "messages" not in line]
    assert [int(k) for k, _ in rows] == [0, 25, 50] and all(float(v) > 0 for _, v in rows), proc.stdout


@pytest.fixture(scope="module")
def generation_quick():
    """One `bench/generation.py --quick` run, shared by the two tests that read its tables."""
    # --no-vllm: with a vLLM interpreter the vLLM row would cost ~45 s of start-up (and vLLM's CPU
    # kernels refuse the tiny model's head_dim); the row must still be there, as a note.
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "generation.py"), "--quick", "--no-vllm"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.timeout(150)
def test_generation_bench_quick(generation_quick):
    proc = generation_quick
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Table rows by their first cell: {"built-in engine": ["512.3", "8100.0", "33/33"], ...}
    rows = table_rows(proc.stdout)
    for engine in ("built-in engine", "transformers generate"):
        assert engine in rows, proc.stdout
        b1, b32, b32_sampled, b32_groups, same = rows[engine]
        assert float(b1) > 0 and float(b32) > 0 and float(b32_sampled) > 0 and float(b32_groups) > 0, rows[engine]
        assert re.fullmatch(r"\d+/33", same), rows[engine]  # 1 + 32 sequences compared with HF
    assert all(rows[f"vLLM, {d}"][4].startswith("skipped") for d in ("float32", "bfloat16")), rows
    for label in ("built-in / HF", "built-in / HF, per CPU second"):
        assert all(re.fullmatch(r"[\d.]+x", c) for c in rows[label][:4]), rows[label]


@pytest.mark.timeout(400)
def test_train_step_bench_quick():
    proc = subprocess.run(
        # A cross-section of the layouts (each row starts its own processes): replicated, sharded, TP, bf16.
        [sys.executable, os.path.join(ROOT, "bench", "train_step.py"), "--quick", "--layouts",
         "plain:d1:float32,torch:d1:float32,fsdp:d2:float32,megatron:d1t2:float32,megatron:d1:bfloat16"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=360,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.strip().strip("|").split("|") for line in proc.stdout.splitlines() if line.startswith("| ")]
    layouts = {(c[0].strip(), c[1].strip()) for c in rows[1:]}  # after the header row
    assert {("plain", "d1"), ("torch", "d1"), ("fsdp", "d2"), ("megatron", "d1t2")} <= layouts, proc.stdout
    for c in rows[1:]:
        assert float(c[3]) > 0 and float(c[4]) > 0, c
    ratio = {(c[0].strip(), c[1].strip()): c[5].strip() for c in rows[1:]}
    assert ratio[("plain", "d1")] == "1.00" and float(ratio[("torch", "d1")]) > 0, proc.stdout  # vs the plain loop


@pytest.mark.timeout(600)
def test_learning_bench_quick(tmp_path):
    # Two of the four settings (a: sync, b: async decoupled; c and d differ from b only in config
    # values) on the tiny model: ~40 s on an idle 2-core machine (mostly process start-up).
    # Nothing about learning.
    out = tmp_path / "learning"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "learning.py"), "--quick", "--settings", "a,b", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=560,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table_rows(proc.stdout, skip="| setting", key=lambda first: first.split(":")[0])
    assert set(rows) == {"a", "b"}, proc.stdout
    for key, cells in rows.items():
        seeds_ok, wall, _train, samples, _first, _last, acc = cells
        assert seeds_ok == "1/1", (key, cells)
        assert float(wall) > 0 and float(samples) == 3 * 4 * 4, (key, cells)  # steps x prompts x samples
        assert " -> " in acc and "n/a" not in acc, (key, cells)  # evaluated before and after
    results = json.loads((out / "results.json").read_text())
    assert [r["rc"] for r in results["runs"]] == [0, 0], results["runs"]
    assert all(len(r["reward"]) == 3 and r["after"]["held-out"] is not None for r in results["runs"])
    png = (out / "learning.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.timeout(200)
def test_weight_update_bench_quick():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "weight_update.py"), "--quick"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table_rows(proc.stdout, skip="| method", key=lambda first: first.split(" (")[0])
    assert set(rows) == {"disk", "memory", "broadcast", "disk, no pause", "memory, no pause", "disk, in flight",
                         "memory, in flight", "broadcast, in flight"}, proc.stdout
    for method, (update_s, resume_s, partial, prefill, _) in rows.items():
        # An update without a pause stalls the engine only for its swap, inside the whole update (a
        # bound in ms would flake on a shared 2-core CI machine; this property cannot).
        assert (update_s == "-") == (method == "broadcast, in flight"), rows
        if "no pause" in method or ("in flight" in method and update_s != "-"):
            assert 0 <= float(resume_s) <= float(update_s), (method, rows)
        assert float(resume_s) > 0 or "no pause" in method or "in flight" in method
        if "in flight" in method:  # nothing interrupted (the bench checks that requests went on across it)
            assert int(partial) == int(prefill) == 0, rows
        else:  # the pause interrupted running requests; resuming them prefills their prompts on top
            assert 0 < int(partial) < int(prefill), rows
    assert re.match(r"group join [\d.]+ s", rows["broadcast"][4]), rows


@pytest.mark.timeout(120)
def test_wire_bench_quick():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "wire.py"), "--quick"], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| measurement")}
    assert re.fullmatch(r"\d+ us", rows["control round trip, median (50 trips, msgpack + MAC)"]), rows
    raw = [v for k, v in rows.items() if k.startswith("raw frames round trip")]
    assert len(raw) == 2 and all(re.fullmatch(r"\d+ us", v) for v in raw), rows  # both processes anywhere, on one core
    assert re.fullmatch(r"\d+ us", next(v for k, v in rows.items() if k.startswith("control round trip, median, both"))), rows
    for name in ("tensor 1 MB over tcp, sender -> ack (median)", "wire MAC (keyed BLAKE3) 1 MB, one side (paid by sender and receiver)",
                 "raw 1 MB over tcp, zero-copy both sides, no msgpack, no MAC (ZeroMQ's ceiling)"):
        assert re.fullmatch(r"[\d.]+ GB/s", rows[name]) and float(rows[name].split()[0]) > 0, rows


@pytest.mark.timeout(150)
def test_generation_bench_quick_bf16_and_logprob_rows(generation_quick):
    """The engine's speed-path rows: bf16 (or why not), the ratios to vLLM, the log-prob error table."""
    proc = generation_quick
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table_rows(proc.stdout)
    bf16 = rows["built-in engine, bf16"]
    if bf16[4].startswith("skipped"):  # a CPU without bf16 instructions says so
        assert "bf16" in bf16[4], bf16
    else:
        assert all(float(x) > 0 for x in bf16[:4]) and re.fullmatch(r"\d+/33", bf16[4]), bf16
    # The tiny model has no vLLM figure: the ratio rows say so instead of dividing by SmolLM2's.
    for dtype in ("float32", "bfloat16"):
        row = rows[f"built-in engine / vLLM {dtype}"]
        assert row[:4] == ["-", "-", "-", "-"] and "no vLLM figure" in row[4], row
    # Log-prob errors against the fp32 recomputation: fp32 is exact up to float noise.
    fp32 = rows["log-probs, built-in engine"]
    assert int(fp32[0]) == 32 * 16 and float(fp32[3]) < 1e-4, fp32
    bf16 = rows["log-probs, built-in engine, bf16"]
    assert bf16[3].startswith("skipped") or float(bf16[3]) < 0.1, bf16
    # The floor row: the float32 engine on bf16-rounded weights differs from float32 (it rounded).
    floor = rows["log-probs, float32 engine, decoder linears' weights rounded to bf16 (floor of bf16 weights)"]
    assert int(floor[0]) == 32 * 16 and 0 < float(floor[3]) < 0.1, floor


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["interrupt", "inflight+keep-stale"])
def test_async_sim_bench_quick(tmp_path, mode):
    # Two launches (sync, async at eta 2) with the cost models of bench/sim_costs.py; ~50 s on an
    # idle 2-core machine, mostly process start-up. `inflight+keep-stale`: the async run updates
    # its server in flight (--inflight, the README's second table) and drops nothing (--keep-stale).
    flags = ["--inflight", "--keep-stale"] if mode == "inflight+keep-stale" else []
    cmd = [sys.executable, os.path.join(ROOT, "bench", "async_sim.py"), "--quick", *flags, "--out", str(tmp_path)]
    proc = subprocess.run(cmd,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table_rows(proc.stdout, skip="| setting", key=lambda first: first.split(",")[0])
    assert set(rows) == {"sync", "async"}, proc.stdout
    tp, tp_all, bound, frac, speedup, _wait, _update, _dropped, head, usage, trained_len = rows["async"]
    assert float(tp) > 0 and float(tp_all) > 0 and float(bound) > 0 and re.fullmatch(r"\d+%", frac) and re.fullmatch(r"[\d.]+x", speedup)
    assert re.fullmatch(r"[\d.]+ / \d+", head), head
    run_cfg = json.load(open(tmp_path / "async-1-2" / "config.json"))["rollout"]
    assert (run_cfg["inflight_weight_update"], run_cfg["drop_stale"]) == ((True, False) if flags else (False, True))
    if not flags:
        assert int(head.split(" / ")[1]) <= 2, head  # eta 2, a hard bound
    # The servers ran the cost model (its utilization lines are in their logs), not the real engine.
    busy, batch, _refill = usage.split(", ")
    assert int(busy.rstrip("%")) > 0 and float(batch) >= 1, usage
    assert float(trained_len) > 0  # counted by the cost-model trainer (its log lines)
    assert float(rows["sync"][0]) > 0, rows["sync"]
    assert ("in-flight updates, stale kept" in proc.stdout) == bool(flags), proc.stdout


@pytest.mark.timeout(420)
def test_gpu_check_quick(tmp_path):
    """bench/gpu_check.py --quick: the GPU check's every row, on this CPU with tiny sizes (so that
    the check itself never rots); each row passes, or skips saying why (a GPU test, nccl on one GPU)."""
    out = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--quick", "--work",
                           str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rows = table_rows(out.read_text(), skip="| check")
    results = {name: cells[0] for name, cells in rows.items() if cells and cells[0] in ("PASS", "FAIL", "SKIP")}
    assert set(results.values()) <= {"PASS", "SKIP"}, results
    for prefix in ("sync ppo-math, tiny", "async ppo-math, memory", "async ppo-math, nccl", "engine tokens/s",
                   "engine greedy tokens", "engine float32 log-probs", "train step, smollm2-135m",
                   "train step, qwen2.5-0.5b"):
        assert any(name.startswith(prefix) and results[name] == "PASS" for name in results), (prefix, results)
    for prefix in ("sync ppo-math, SmolLM2-135M", "async ppo-math, disk"):  # --quick launches one run of a kind
        assert any(name.startswith(prefix) for name in results), (prefix, results)
    gpu_tests = [name for name in results if name.startswith("test ")]
    assert gpu_tests and all(results[n] == "SKIP" for n in gpu_tests), results  # no GPU here: each says what it needs


@pytest.mark.timeout(600)
def test_algorithms_bench_quick(tmp_path):
    # Two algorithms (one with a critic) on the tiny model, 3 steps: the table and the picture come out,
    # every run ends, and the critic's value loss is reported only where there is a critic. Nothing
    # about learning (the tiny random model learns nothing in 3 steps).
    out = tmp_path / "algorithms"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "algorithms.py"), "--quick", "--algorithms", "rloo,ppo-critic",
         "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=560,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table_rows(proc.stdout, skip="| algorithm", key=lambda first: first)
    assert set(rows) == {"rloo", "ppo-critic"}, proc.stdout
    for algo, (seeds_ok, _first, _last, acc, value_loss, step_s) in rows.items():
        assert seeds_ok == "1/1" and " -> " in acc and "n/a" not in acc and float(step_s) > 0, (algo, rows[algo])
        assert (value_loss == "-") == (algo == "rloo"), (algo, value_loss)
    results = json.loads((out / "results.json").read_text())
    assert [len(r["reward"]) for r in results["runs"]] == [3, 3], results["runs"]
    assert (out / "algorithms.png").read_bytes().startswith(b"\x89PNG")
