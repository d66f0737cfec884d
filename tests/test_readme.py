"""The README's set-up commands are the ones CI runs."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.+?)\n```", setup)


def test_readme_gives_two_commands_and_ci_runs_the_test_one():
    main, tests = readme_commands()
    assert "python -m realcore.launch experiment=ppo-math" in main and "torch==2.13.0" in main
    assert "pytest" in tests
    ci = open(os.path.join(REPO, ".ci", "run")).read().splitlines()
    assert tests in ci
