"""Memory over a long run: a tiny async run's RSS per process, per minute.

    python bench/soak.py [--minutes 10] [--max-growth-mb 50] [--quick] [--out DIR]

Launches `python -m realcore.launch experiment=async-ppo-math model=tiny dataset=tiny-arith` (one
generation server, one model worker, one rollout worker, their manager, the master; steps enough
to outlast the soak), samples the RSS of every process in the launcher's tree every few seconds
(psutil; named by role from their `--type/--index` arguments), stops the run with SIGINT after
`--minutes`, and prints a markdown table: each process's RSS at each minute, then its growth from
the end of the warm-up (minute 2) to the end. Exits 1 when a process grew by more than
`--max-growth-mb`, 2 when the run itself failed.
`--quick`: 30 s of training, a column every 10 s, warm-up 10 s (the smoke test's run; too short to
say anything about growth, so its limit is loose: 200 MB).
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_S = 2.0
STOP_TIMEOUT_S = 60.0


def run_command(out: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "model=tiny", "dataset=tiny-arith",
            "eval.freq_steps=null", "allocation_mode=local.d1p1t1+d1p1t1", "rollout.n_workers=1",
            "trainer.total_steps=1000000", "trainer.batch_size=4", "generation.n_samples=2",
            "generation.max_new_tokens=8", f"output_dir={out}/run", f"model.cache_dir={out}/cache",
            f"system.name_resolve.root={out}/nr", *extra]


def role(p: psutil.Process, roles: dict[int, str]) -> str:
    """`model_worker/0` from `run_worker --type model_worker --index 0`; a helper process (a
    reward's worker) as its parent's role and its own name: `rollout_worker/0:realcore-reward`."""
    try:
        argv, name, ppid = p.cmdline(), p.name(), p.ppid()
    except psutil.Error:
        return f"?({p.pid})"
    if "--type" in argv:
        kind = argv[argv.index("--type") + 1]
        if "--index" in argv and kind not in ("master", "gserver_manager"):
            return f"{kind}/{argv[argv.index('--index') + 1]}"
        return kind
    return f"{roles.get(ppid, '?')}:{name}"


def sample(launcher: psutil.Process) -> dict[str, float]:
    """RSS in MB of the launcher and each process under it."""
    rss, roles = {}, {launcher.pid: "launcher"}
    try:
        procs = launcher.children(recursive=True)  # parents before their children
    except psutil.Error:
        return rss
    for p in [launcher, *procs]:
        try:
            mb = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
        name = roles.setdefault(p.pid, role(p, roles))
        rss[name] = rss.get(name, 0.0) + mb  # two helpers of one name count together
    return rss


def steps_done(out: str) -> int:
    try:
        with open(os.path.join(out, "run", "metrics.jsonl"), "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def stop(popen: subprocess.Popen) -> int:
    if popen.poll() is None:
        popen.send_signal(signal.SIGINT)  # the launcher stops every worker and exits 130
    try:
        return popen.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        return popen.wait(STOP_TIMEOUT_S)


def table(cols: list[tuple[float, dict[str, float], int]], warm_s: float, unit: str, limit: float) -> tuple[str, dict]:
    """Markdown: a row per process, a column per sample time, then the growth after warm-up."""
    names = sorted({n for _, rss, _ in cols for n in rss}, key=lambda n: (n != "launcher", n != "master", n))
    warm = min(cols, key=lambda c: abs(c[0] - warm_s))
    head = [f"{t / (60 if unit == 'min' else 1):g} {unit}" for t, _, _ in cols]
    lines = ["| process | " + " | ".join(head) + f" | growth after {warm[0] / (60 if unit == 'min' else 1):g} {unit} |",
             "|---" * (len(head) + 2) + "|"]
    growth = {}
    for n in names:
        vals = [rss.get(n) for _, rss, _ in cols]
        if n in warm[1] and n in cols[-1][1]:
            growth[n] = cols[-1][1][n] - warm[1][n]
        g = f"{growth[n]:+.0f}" + (" **over**" if growth.get(n, 0) > limit else "") if n in growth else "-"
        lines.append(f"| {n} | " + " | ".join("-" if v is None else f"{v:.0f}" for v in vals) + f" | {g} |")
    lines.append("| steps done | " + " | ".join(str(s) for _, _, s in cols) + " | |")
    return "\n".join(lines), growth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--max-growth-mb", type=float, default=None, help="default 50 (--quick: 200)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="the run's folder (default: a temporary one, removed)")
    ap.add_argument("overrides", nargs="*", help="more config overrides for the run (key=value)")
    args = ap.parse_args()
    if not args.quick and args.minutes <= 2:
        ap.error("--minutes must be more than 2: growth is measured after the first two")
    if args.quick:
        total_s, col_s, warm_s, unit, limit = 30.0, 10.0, 10.0, "s", args.max_growth_mb or 200.0
    else:
        total_s, col_s, warm_s, unit, limit = args.minutes * 60, 60.0, 120.0, "min", args.max_growth_mb or 50.0
    out = args.out or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(os.path.join(out, "launcher.log"), "wb")
    popen = subprocess.Popen(run_command(out, args.overrides), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    launcher = psutil.Process(popen.pid)
    cols, t0, next_col, rss = [], None, 0.0, {}
    deadline = time.monotonic() + total_s + 600  # start-up (tiny model, dataset) has ten minutes at most
    try:
        while popen.poll() is None and time.monotonic() < deadline:
            rss = sample(launcher)
            if t0 is None and steps_done(out) > 0:  # minute 0 is the first training step
                t0 = time.monotonic()
            if t0 is not None:
                now = time.monotonic() - t0
                if now >= next_col:
                    cols.append((next_col, rss, steps_done(out)))
                    print(f"soak: {next_col:.0f} s, {cols[-1][2]} steps: "
                          + ", ".join(f"{n} {v:.0f}" for n, v in sorted(rss.items())) + " (MB)", flush=True)
                    next_col += col_s
                    if next_col > total_s + 1e-6:
                        break
            time.sleep(SAMPLE_S)
    finally:
        rc = stop(popen)
        log.close()
    ok_exit = rc in (130, -signal.SIGINT)
    if not cols or not ok_exit or len(cols) * col_s <= total_s:
        with open(os.path.join(out, "launcher.log"), errors="replace") as f:
            sys.stderr.write(f.read()[-3000:])
        print(f"soak: the run failed or ended early (launcher exit {rc}, {len(cols)} samples); folder {out}",
              file=sys.stderr)
        return 2
    text, growth = table(cols, warm_s, unit, limit)
    print(text)
    over = {n: g for n, g in growth.items() if g > limit}
    print(f"soak: {psutil.cpu_count()} cores, tiny model; steps {cols[-1][2]} in {cols[-1][0]:.0f} s; "
          + (f"grew over {limit:g} MB after warm-up: {over}" if over else f"no process grew over {limit:g} MB after warm-up"))
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
