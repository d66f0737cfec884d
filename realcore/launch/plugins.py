"""Load the built-in registrations and the user's modules named by `imports:` (launcher and workers alike)."""

from __future__ import annotations

import importlib
import os
import sys

import realcore.data  # noqa: F401  (registers built-in datasets and rewards)
import realcore.mfc  # noqa: F401  (registers built-in MFCs)
import realcore.workflows  # noqa: F401  (registers built-in rollout workflows and environments)


def load_plugins(imports: list[str]) -> None:
    # A user's module usually sits in the directory the run was started from.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for i, name in enumerate(imports):
        try:
            importlib.import_module(name)
        except Exception as e:
            raise ValueError(f"imports[{i}]: cannot import {name!r}: {type(e).__name__}: {e}") from None
