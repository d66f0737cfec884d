"""Cost models of a GPU generation server and a GPU trainer, for bench/async_sim.py.

The only fake part of that benchmark. bench/sim_plugin.py, imported by every process of a run
through the experiments' `imports: [bench.sim_plugin]`, calls `install()`, which replaces two
classes by name (importing this module alone changes nothing):
- `realcore.backends.generation.GenerationEngine` (the built-in engine behind every local
  generation server, and behind the actor's `generate` in sync mode) by `SimGenerationEngine`:
  the same request interface (add, step, abort, retract, load weights), with compute replaced by
  sleeping: a decode step costs `decode_step_s` whatever the running batch (up to the server's
  max batch), as on a GPU; admitting requests costs `prefill_s_per_token` per token prefilled.
  A response's length is drawn once per request from a lognormal (seeded), capped at
  max_new_tokens; its tokens are dummy ids.
- `realcore.backends.torch_engine.TorchEngine` by `SimTrainEngine`: the real engine (the small
  real model, so checkpoints and weight updates are real), whose training micro-steps and
  log-prob passes sleep `train_s_per_token` / `logp_s_per_token` per token instead of computing.
  Each minibatch still bumps the version (a completed optimizer step).
Everything else (launcher, master, DFG, model workers, servers' HTTP API and interruption, gserver
manager, rollout workers, reward, stream, staleness control, weight updates) is the real code.

The costs come from the environment variable SIM_COSTS (JSON of `SimCosts` fields), which the
launcher passes on to every worker.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from realcore.api.engine import GenerationResult

ENV = "SIM_COSTS"
LOG_S = 2.0
log = logging.getLogger("bench.sim_costs")


@dataclass(frozen=True)
class SimCosts:
    decode_step_s: float = 0.02  # one decode step of the whole running batch (a GPU's fixed step cost)
    prefill_s_per_token: float = 2e-5  # prefill, per prompt (or resumed prefix) token
    train_s_per_token: float = 3e-4  # forward + backward + optimizer share, per trained token
    logp_s_per_token: float = 1e-4  # a log-prob (inference) pass, per token
    len_median: float = 40.0  # lognormal response length: median exp(mu)
    len_sigma: float = 1.0  # ... and sigma of log-length (the tail)
    seed: int = 0

    def length(self, z: float) -> int:
        """The response length at standard-normal deviate z (uncapped)."""
        return max(1, math.ceil(self.len_median * math.exp(self.len_sigma * z)))

    def mean_len(self, cap: int) -> float:
        """E[min(L, cap)], numerically over 10,000 quantiles."""
        n, normal = 10_000, statistics.NormalDist()
        return sum(min(cap, self.length(normal.inv_cdf((q + 0.5) / n))) for q in range(n)) / n

    def max_len(self, n: int, cap: int) -> float:
        """E[max of n lengths, each capped]: a sync rank waits for its longest response."""
        m, normal = 4000, statistics.NormalDist()
        # the max of n draws is at quantile u^(1/n) of one draw, u uniform
        return sum(min(cap, self.length(normal.inv_cdf(((q + 0.5) / m) ** (1 / n)))) for q in range(m)) / m

    @staticmethod
    def from_env() -> "SimCosts":
        return SimCosts(**json.loads(os.environ.get(ENV, "{}")))

    def to_env(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class _SimRequest:
    rid: int
    prompt_ids: list[int]
    gconfig: object
    left: int  # output tokens of the drawn length not generated before this segment
    target: int  # output tokens this segment produces: min(left, max_new_tokens)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def result(self) -> GenerationResult:
        return GenerationResult(list(self.output_ids), [-1.0] * len(self.output_ids), self.finish_reason)


class SimGenerationEngine:
    """GenerationEngine's interface; decoding is a sleep of `decode_step_s` per step.

    Interruption: an aborted request's rest is remembered under its prompt + partial output (random
    dummy ids make that key unique), so the rollout worker's resubmission of that prefix (to the
    same server) continues the same response length rather than drawing a new one (which would
    shorten the tail)."""

    def __init__(self, model, tokenizer, *, seed: int = 0, dtype: str | None = None):  # dtype: costs do not depend on it
        self.costs = SimCosts.from_env()
        self.model, self.tokenizer = model, tokenizer
        self.rng = random.Random(self.costs.seed * 1_000_003 + seed)
        eos = tokenizer.eos_token_id
        vocab = min(len(tokenizer), 50_000)
        self.token_ids = [i for i in range(vocab // 4, vocab) if i != eos][:4096]  # dummy ids, never EOS
        self.next_rid = 0
        self._waiting: collections.deque[_SimRequest] = collections.deque()
        self._running: list[_SimRequest] = []
        self._rest: dict[tuple[int, ...], int] = {}  # prompt + partial output of an aborted request -> tokens left
        # Utilization, logged every LOG_S (bench/async_sim.py reads the last line of each server's log).
        self.usage = {"decode_steps": 0, "batch_sum": 0, "busy_s": 0.0, "refills": 0, "refill_s": 0.0}
        self._refill: tuple[float, int] | None = None  # since an abort of everything: (when, batch to get back to)
        self.started: float | None = None
        self.logged, self.last_usage = 0.0, dict(self.usage)
        atexit.register(self._log_usage, True)  # a short run may end before the next periodic line

    def add_request(self, prompt_ids: list[int], gconfig) -> int:
        if not prompt_ids:
            raise ValueError("generation: empty prompt")
        cap = gconfig.max_new_tokens
        left = self._rest.pop(tuple(prompt_ids), None)
        if left is None:
            left = self.costs.length(self.rng.gauss(0.0, 1.0))
        rid = self.next_rid
        self.next_rid += 1
        self._waiting.append(_SimRequest(rid, list(prompt_ids), gconfig, left, min(left, cap)))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def n_running(self) -> int:
        return len(self._running)

    def output_lengths(self) -> dict[int, int]:
        return {r.rid: len(r.output_ids) for r in (*self._waiting, *self._running)}

    def abort(self, rids: list[int] | None = None) -> list[tuple[int, GenerationResult]]:
        if rids is None and self._running:  # a pause for a weight update: time until the batch is back
            n = len(self._running) + len(self._waiting)
            self._refill = (time.monotonic(), min(n, self._running[0].gconfig.max_batch_size))
        done = []
        for r in [r for r in self._waiting if rids is None or r.rid in rids] + \
                 [r for r in self._running if rids is None or r.rid in rids]:
            if r.output_ids and r.left > len(r.output_ids):
                self._rest[tuple(r.prompt_ids + r.output_ids)] = r.left - len(r.output_ids)
            r.finish_reason = "abort"
        for r in [r for r in self._waiting if r.finish_reason]:
            self._waiting.remove(r)
            done.append((r.rid, r.result()))
        return done + self._retire()

    def retract(self) -> int:
        n = len(self._running)
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        return n

    def generate(self, prompts: list[list[int]], gconfig) -> list[GenerationResult]:
        assert not self.has_unfinished(), "generate() needs an idle engine"
        rids = [self.add_request(p, gconfig) for p in prompts]
        done: dict[int, GenerationResult] = {}
        while self.has_unfinished():
            done.update(self.step())
        return [done[r] for r in rids]

    def step(self) -> list[tuple[int, GenerationResult]]:
        """One decode step for the running batch (fixed cost), then admit waiting requests (prefill)."""
        if self._running:
            self._sleep(self.costs.decode_step_s)
            self.usage["decode_steps"] += 1
            self.usage["batch_sum"] += len(self._running)
            for r in self._running:
                self._emit(r)
        finished = self._retire()
        new = []
        while self._waiting and len(self._running) + len(new) < self._waiting[0].gconfig.max_batch_size:
            new.append(self._waiting.popleft())
        if new:
            self._sleep(self.costs.prefill_s_per_token * sum(len(r.prompt_ids) + len(r.output_ids) for r in new))
            for r in new:  # prefill samples each request's first token
                self._emit(r)
            self._running += new
        if self._refill is not None and len(self._running) >= self._refill[1]:
            self.usage["refills"] += 1
            self.usage["refill_s"] += time.monotonic() - self._refill[0]
            self._refill = None
        finished += self._retire()
        self._log_usage()
        return finished

    def _sleep(self, seconds: float) -> None:
        self.started = time.monotonic() if self.started is None else self.started
        time.sleep(seconds)
        self.usage["busy_s"] += seconds

    def _log_usage(self, at_exit: bool = False) -> None:
        """Every LOG_S while busy, whenever the engine runs dry, and at exit (so a short run logs too)."""
        now = time.monotonic()
        due = at_exit or now - self.logged >= LOG_S or not self.has_unfinished()
        if self.started is None or not due or self.usage == self.last_usage:
            return
        self.logged, self.last_usage, u = now, dict(self.usage), self.usage
        log.info("sim: %d decode steps, mean running batch %.1f, busy %.3f s of %.3f s since the first request; "
                 "%d interruptions, %.3f s each until the batch was back", u["decode_steps"],
                 u["batch_sum"] / max(1, u["decode_steps"]), u["busy_s"], now - self.started, u["refills"],
                 u["refill_s"] / max(1, u["refills"]))

    def _emit(self, r: _SimRequest) -> None:
        if len(r.output_ids) < r.target:
            r.output_ids.append(self.rng.choice(self.token_ids))
        if len(r.output_ids) >= r.target:  # the drawn length ends here ("stop"), or the cap cuts it
            r.finish_reason = "stop" if r.left <= r.gconfig.max_new_tokens else "length"

    def _retire(self) -> list[tuple[int, GenerationResult]]:
        done = [(r.rid, r.result()) for r in self._running if r.finish_reason is not None]
        self._running = [r for r in self._running if r.finish_reason is None]
        return done

    def load_weights(self, tensors: dict[str, torch.Tensor], *, partial: bool = False) -> None:
        """Real: the model's weights change (cheap for the small model); the cost of moving a large
        model's weights is not modelled."""
        state = self.model.state_dict()
        unknown = sorted(set(tensors) - set(state))
        if unknown:
            raise ValueError(f"weights: {len(unknown)} unknown parameter(s), e.g. {unknown[:3]}")
        with torch.no_grad():
            for name, t in tensors.items():
                state[name].copy_(t)


def _sim_train_engine(base):
    class SimTrainEngine(base):
        """The torch engine with its compute replaced by sleeping per token (module docstring)."""

        costs = SimCosts.from_env()

        def logprobs(self, input_ids, temperature=1.0, *, max_tokens_per_mb=None):
            time.sleep(self.costs.logp_s_per_token * sum(int(x.numel()) for x in input_ids))
            return [torch.zeros(int(x.numel())) for x in input_ids]

        def values(self, input_ids, *, max_tokens_per_mb=None):  # a critic's forward costs what the policy's does
            return self.logprobs(input_ids)

        def scores(self, input_ids, *, max_tokens_per_mb=None):
            return [v[-1] for v in self.logprobs(input_ids)]

        def _train_minibatch(self, data, loss_fn, loss_weight_fn, temperature, max_tokens_per_mb, group_sizes=None):
            tokens = sum(int(x.numel()) for x in data["input_ids"])
            # bench/async_sim.py's training bound counts these (trained samples may be shorter than the average)
            log.info("sim: trained %d sequences, %d tokens", len(data["input_ids"]), tokens)
            time.sleep(self.costs.train_s_per_token * tokens)
            self.optimizer.step()  # no gradients: changes nothing, but keeps the schedule's order
            self.scheduler.step()
            self.version += 1
            return {"lr": self.optimizer.param_groups[0]["lr"], "grad_norm": 0.0}

    return SimTrainEngine


def install() -> None:
    """Replace the two engine classes in this process (what bench/sim_plugin.py does on import)."""
    from realcore.backends.genserver import engine_loop
    from realcore.backends import generation, torch_engine

    if getattr(torch_engine.TorchEngine, "is_sim", False):
        return
    generation.GenerationEngine = SimGenerationEngine
    engine_loop.GenerationEngine = SimGenerationEngine
    torch_engine.TorchEngine = _sim_train_engine(torch_engine.TorchEngine)
    torch_engine.TorchEngine.is_sim = True

