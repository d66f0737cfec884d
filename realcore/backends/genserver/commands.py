"""What the HTTP server and the weight receiver send the engine thread (realcore.backends.genserver.engine_loop),
one typed command each, and the errors it answers with.

Each command carries `done`, called once (on the engine thread) with a result or an exception;
a caller waits at most CONTROL_TIMEOUT_S for a control command.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from realcore.api.config import GenerationConfig

CONTROL_TIMEOUT_S = 60.0  # a control command waits for at most one decode step; this is generous


class Unavailable(RuntimeError):
    """The engine thread stopped or did not answer in time (HTTP 503)."""


class RequestFailed(RuntimeError):
    """The engine thread raised while running this one request or command (HTTP 500)."""


INCOMPLETE = "the weights are incomplete (a broadcast stopped between its buckets): waiting for a complete update"


@dataclass
class _Generate:
    rid: str
    input_ids: list[int]
    gconfig: GenerationConfig
    return_logprob: bool
    done: Callable[[Any], None]
    adapters: frozenset[str] = frozenset()  # lora_path names asked for: checked on admission, after any pause
    restarted: bool = False  # it was in a failed decode step once and started again
    # (first output token index, version) from admission on: which version sampled which tokens when
    # an update lands without aborting the request (it goes on with its KV cache: in-flight update).
    spans: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class _Abort:
    rid: str | None  # None = all
    done: Callable[[Any], None]


@dataclass
class _Pause:
    mode: str
    done: Callable[[Any], None]


@dataclass
class _Continue:
    done: Callable[[Any], None]


@dataclass
class _Weights:
    tensors: dict[str, torch.Tensor]
    version: str | None
    done: Callable[[Any], None]
    partial: bool = False  # one bucket of a broadcast update: not every parameter
    abort_all: bool = False  # SGLang's abort_all_requests: every request ends (partial output) just before
    abort_before: int | None = None  # then, requests whose first token's version is below this end (partial output)


@dataclass
class _Adapter:
    """Load (tensors given) or unload (tensors None) the LoRA adapter `name`."""

    name: str
    config: dict | None
    tensors: dict[str, torch.Tensor] | None
    version: str | None
    done: Callable[[Any], None]
    abort_all: bool = False
    abort_before: int | None = None  # as _Weights'


@dataclass
class _Version:
    """SGLang's /update_weight_version: replies carry `version` from now on (weights unchanged)."""

    version: str
    done: Callable[[Any], None]
    abort_before: int | None = None  # as _Weights'
