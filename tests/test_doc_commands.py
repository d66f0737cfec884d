"""The README's and the docs' cheap command examples stay true: every `python -m realcore.launch ...`
shown composes into a valid configuration (without running it), `python -m realcore.dfg show` prints
the graph the README shows, and the `--dry-run` plan of an 8-GPU node prints what docs/gpus.md shows."""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
# Shown with a placeholder for the user to fill in, or not a launch at all: not composed.
PLACEHOLDERS = ("DIR", "FILE", "NAME", "PREFIX", "<")


def shown(prog: str) -> list[tuple[str, str]]:
    """(page, command) for every `python -m PROG ...` in a code block or inline code of a page;
    continuation lines joined, a leading `cd X && ` or `pip ... && ` dropped."""
    found = []
    for page in PAGES:
        text = open(os.path.join(REPO, page)).read()
        lines = [line for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL)
                 for line in block.replace("\\\n", " ").splitlines()]  # a block: one command a line
        lines += re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.DOTALL))  # inline: one
        for line in lines:
            line = " ".join(line.split()).removeprefix("$ ")
            for part in line.split(" && "):
                if part.startswith(f"python -m {prog} "):
                    found.append((page, part))
    return found


def overrides(command: str) -> list[str]:
    """The key=value arguments of a launch line, as the launcher gets them."""
    args = shlex.split(command)[3:]
    args = [a.replace("$PWD", os.path.join(REPO, "examples")) for a in args]
    return [a for a in args if not a.startswith("--")]


LAUNCHES = sorted({(p, c) for p, c in shown("realcore.launch")
                   if not any(w in c for w in PLACEHOLDERS) and "--help" not in c and "=" in c})


def test_the_pages_show_launch_commands():
    pages = {p for p, _ in LAUNCHES}
    assert {"README.md", "docs/extending.md", "docs/clusters.md", "docs/recovery.md"} <= pages, pages
    assert any("experiment=mine" in c for _, c in LAUNCHES)  # the own-MFC example, through examples/


@pytest.mark.parametrize("page,command", LAUNCHES, ids=[f"{p}:{c[26:72]}" for p, c in LAUNCHES])
def test_each_launch_command_shown_composes(page, command):
    from realcore.launch.config_loader import load_config

    cfg = load_config(overrides(command))
    for o in overrides(command):
        key, _, value = o.partition("=")
        if key == "experiment":
            assert cfg.experiment_name == value, (page, command)


GRAPHS = sorted({(p, c) for p, c in shown("realcore.dfg") if c.startswith("python -m realcore.dfg show ")})


@pytest.mark.parametrize("page,command", GRAPHS, ids=[f"{p}:{c[28:74]}" for p, c in GRAPHS])
def test_each_dfg_show_command_shown_builds_its_graph(page, command, tmp_path):
    """Run as shown (from examples/ when it names the example's folder), the picture into tmp_path."""
    argv = [o if not o.startswith("out=") else f"out={tmp_path}/dfg.png" for o in overrides(command)]
    cwd = os.path.join(REPO, "examples") if "$PWD" in command else REPO
    r = run(["realcore.dfg", "show", *argv[1:]], cwd=cwd)
    assert r.returncode == 0 and "[ppo_update on actor]" in r.stdout, (page, command, r.stderr[-2000:])


def run(argv: list[str], env: dict | None = None, timeout: int = 600, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": REPO, **(env or {})})


def test_dfg_show_prints_the_graph_the_readme_shows(tmp_path):
    assert ("README.md", "python -m realcore.dfg show experiment=ppo-math") in shown("realcore.dfg")
    text = open(os.path.join(REPO, "README.md")).read()
    block = next(b for b in re.findall(r"```\n(.*?)```", text, re.DOTALL) if b.startswith("source: "))
    r = run(["realcore.dfg", "show", "experiment=ppo-math", f"out={tmp_path}/dfg.png"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert block.strip() in r.stdout, r.stdout
    assert os.path.getsize(tmp_path / "dfg.png") > 0


def test_the_dry_run_of_an_8_gpu_node_prints_the_plan_gpus_md_shows(tmp_path):
    """REALCORE_TEST_NODE_GPUS makes the launcher believe in 8 GPUs (a test switch)."""
    text = open(os.path.join(REPO, "docs", "gpus.md")).read()
    command = "python -m realcore.launch --dry-run experiment=async-ppo-math allocation_mode=local.d4p1t1+d4p1t1"
    block = text.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    plan = [line for line in block.splitlines() if line.startswith("  ") and "..." not in line]
    assert len(plan) >= 5 and block.rstrip().endswith("realcore: dry run: nothing was started")
    out = tmp_path / "run"
    r = run([*command.split()[2:], f"output_dir={out}"], env={"REALCORE_TEST_NODE_GPUS": "8"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert all(line in r.stdout.splitlines() for line in plan), r.stdout
    assert "realcore: dry run: nothing was started" in r.stdout
    assert not out.exists()  # a dry run writes nothing


def script_runs() -> list[tuple[str, str]]:
    """(page, command) for every `python examples/FILE.py key=value ...` shown (a realcore.Controller loop)."""
    found = []
    for page in PAGES:
        for m in re.finditer(r"python (examples/\w+\.py)((?: [\w.\[\]=,\-]+)*)", open(os.path.join(REPO, page)).read()):
            found.append((page, m.group(0)))
    return sorted(set(found))


def test_each_script_shown_exists_and_its_overrides_compose():
    from realcore.launch.config_loader import load_config

    runs = script_runs()
    assert {c.split()[1] for _, c in runs} >= {"examples/grpo_loop.py", "examples/async_grpo_loop.py"}, runs
    for page, command in runs:
        path = os.path.join(REPO, command.split()[1])
        assert os.path.isfile(path), (page, command)
        default = re.search(r'Controller\(experiment="([\w-]+)"\)', open(path).read())
        assert default, f"{path}: Controller(experiment=...) not found"
        cfg = load_config([f"experiment={default.group(1)}", *command.split()[2:]])
        assert cfg.experiment_name == default.group(1), (page, command)
