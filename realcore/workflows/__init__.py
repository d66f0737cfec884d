"""Rollout workflows (realcore.api.workflow) and what they run on: the built-in math workflows and
environments (registered on import), the engines a workflow calls, the sandbox of tool calls."""

from realcore.workflows import math  # noqa: F401
