"""The master's side of an RL loop written as a Python file (realcore.Controller): the loop's verbs
over the Master that the graph's own loop (Master.loop) uses.

A step of a script: take a batch (`rollout`: sync, the dataset's next prompts and the graph's
generating MFCs on them; async, the stream's next batch under the staleness bound), run MFCs of the
graph on it by name (`call`), publish the weights, evaluate. The step ends when the script asks for
the next one (`steps`): then comes what Master.loop does after its MFCs (Master.end_step: ledger,
release, metrics row, checkpoints), and what the config schedules that the script did not do itself
this step (weights published, evaluation at eval.freq_steps). The same MFCs in the graph's order
make the same calls on the workers as the graph's loop: the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import types
from collections.abc import Iterator

from realcore.api.registry import mfc_spec
from realcore.dfg.graph import MFCNode
from realcore.trainer.batch_source import Group
from realcore.trainer.master import Master
from realcore.trainer.metrics import print_reward_summary
from realcore.transport.columns import merged_stats
from realcore.transport.reply import wait_all

log = logging.getLogger("realcore.controller")


class LoopError(ValueError):
    """A verb used out of turn (an MFC on a batch that lacks its inputs, a verb outside a step)."""


@dataclasses.dataclass(eq=False)  # a batch is itself: `in` compares identity
class Batch:
    """A batch as the script holds it: metadata only (sample ids); the tensors stay on the workers."""

    step: int
    ids: list[int]
    groups: list[Group]
    version: int  # the policy version when it was taken
    stats: dict  # what taking it and the MFCs run on it reported: reward/mean, loss, staleness/...
    ran: list[str] = dataclasses.field(default_factory=list)  # the MFCs run on it, in order

    def __len__(self) -> int:
        return len(self.ids)


@dataclasses.dataclass
class _Step:
    step: int
    t0: float
    version: int  # the policy version at the step's start (the ledger's trained version)
    metrics: dict
    batches: list[Batch] = dataclasses.field(default_factory=list)
    evaluated: bool = False
    saved: bool = False
    last: bool = False


class ScriptLoop:
    """The loop's verbs; `steps()` drives the run (resume, step ends, the end)."""

    def __init__(self, master: Master):
        self.master = master
        self.cfg = master.cfg
        self.nodes = {n.name: n for n in master.nodes}
        # The graph's MFCs as callables: ctl.mfc.actor_train(batch) is ctl.call("actor_train", batch).
        self.mfc = types.SimpleNamespace(**{name: functools.partial(self.call, name) for name in self.nodes})
        self._cur: _Step | None = None
        self._records = None  # (MetricsWriter, Ledger) once steps() began

    @property
    def step(self) -> int:
        """The step running (in steps()), else the last one finished."""
        return self._cur.step if self._cur is not None else self.master.step

    @property
    def version(self) -> int:
        """The policy version: completed updates of the policy."""
        return self.master.version

    @property
    def mfc_names(self) -> list[str]:
        return list(self.nodes)

    # --- the run ------------------------------------------------------------------------------

    def steps(self) -> Iterator[int]:
        """The steps left to run, from the one after the last recover checkpoint (a restarted run
        goes on where it stopped) to trainer.total_steps; each ends when the next is asked for."""
        if self._records is not None:
            raise LoopError("steps(): called twice; a run has one loop")
        m = self.master
        self._records = m.begin()
        writer, ledger = self._records
        try:
            for step in range(m.step + 1, self.cfg.trainer.total_steps + 1):
                t0 = time.perf_counter()
                self._cur = _Step(step, t0, m.version, {"step": step})
                yield step
                cur, self._cur = self._cur, None
                self._end(cur)
                if cur.last:
                    break
        except GeneratorExit:  # the script left the loop (break) inside a step
            if self._cur is not None:
                log.warning("the loop left step %d before it ended: its metrics row and checkpoints are not written "
                            "(ctl.stop() ends a run after the current step)", self._cur.step)
            raise
        finally:
            self._cur = None
            writer.close()
            ledger.close()
        print_reward_summary(writer.path)

    def stop(self) -> None:
        """End the run after this step: it ends as the last one would (checkpoints written)."""
        self._current("stop").last = True

    def _current(self, verb: str) -> _Step:
        if self._cur is None:
            raise LoopError(f"{verb}(): only inside `for step in ctl.steps():`")
        return self._cur

    def _end(self, cur: _Step) -> None:
        m = self.master
        kept = cur.batches
        metrics = cur.metrics
        stats = kept[0].stats if len(kept) == 1 else merged_stats([(b.stats, len(b)) for b in kept])
        metrics.update({k: v for k, v in stats.items() if k not in metrics})
        m.publish(metrics)  # the servers must follow the policy (the staleness bound counts on it)
        if not cur.evaluated and m.eval_due(cur.step):
            metrics.update(m.evaluate())
        m.end_step(cur.step, metrics, [g for b in kept for g in b.groups], cur.version, cur.t0, *self._records,
                   ids=[i for b in kept for i in b.ids], last=cur.last or None, save=not cur.saved)

    # --- the verbs ----------------------------------------------------------------------------

    def rollout(self) -> Batch:
        """The next batch of trainer.batch_size samples: sync, the dataset's next prompts with the
        graph's generating MFCs run on them (the rollout workflow: responses and rewards); async,
        the first groups to reach the trainer's streams, too-stale ones dropped."""
        cur = self._current("rollout")
        m = self.master
        stats: dict = {}
        groups = m.source.fetch(stats)
        batch = Batch(cur.step, [g.sid for g in groups], groups, m.version, stats)
        cur.batches.append(batch)
        if not m.async_mode:
            for node in m.nodes:
                if mfc_spec(node.type).generates:
                    self.call(node.name, batch)
        return batch

    def call(self, name: str, batch: Batch) -> dict:
        """Run the graph's MFC `name` on `batch` (on its role's workers, node.n_seqs samples per
        call, as the graph does), waited for: its stats (also kept in batch.stats)."""
        cur = self._current(name)
        m = self.master
        node = self.nodes.get(name)
        if node is None:
            raise LoopError(f"no MFC named {name!r} in this experiment's graph (it has {', '.join(self.nodes)})")
        if batch not in cur.batches:
            raise LoopError(f"MFC {name}: the batch is not one of this step's (taken in step {batch.step}, or dropped)")
        if name in batch.ran:
            raise LoopError(f"MFC {name} ran on this batch already")
        missing = [k for k in node.inputs if k not in m.buffer.common_keys(batch.ids)]
        if missing:
            makers = sorted({n.name for n in m.nodes if set(n.outputs) & set(missing)})
            hint = f": run {', '.join(makers)} on it first" if makers else ""
            raise LoopError(f"MFC {name} needs {', '.join(missing)}, which the batch does not hold{hint}")
        stats: dict = {}
        for i in range(0, len(batch.ids), node.n_seqs):
            self._run(node, batch.ids[i:i + node.n_seqs], cur, stats)
        batch.ran.append(name)
        batch.stats.update(stats)
        return stats

    def _run(self, node: MFCNode, ids: list[int], cur: _Step, stats: dict) -> None:
        m = self.master
        sent = time.perf_counter()
        _, futs = m.dispatch(node, ids, set(), chain=False)
        wait_all(futs, self.cfg.system.request_timeout_s, f"MFC {node.name}")
        m.collect([node], ids, futs, sent, cur.t0, cur.metrics, stats)  # its time to the step, its stats to the batch

    def update_weights(self) -> None:
        """Publish the current policy to the generation servers (nothing when generation is
        colocated, or when they hold it already); a step that does not publishes at its end."""
        self.master.publish(self._current("update_weights").metrics)

    def evaluate(self) -> dict:
        """eval/* of the current policy now (it is published first); the step then runs no
        scheduled evaluation."""
        cur = self._current("evaluate")
        self.master.publish(cur.metrics)
        out = self.master.evaluate()
        cur.metrics.update(out)
        cur.evaluated = True
        return out

    def save(self) -> None:
        """An HF checkpoint of every trainable role now (checkpoints/step_N); the step's end then
        writes no scheduled one."""
        cur = self._current("save")
        self.master.save(cur.step)
        cur.saved = True

    def log(self, **values: float) -> None:
        """Values of the script's own for this step's metrics row."""
        self._current("log").metrics.update(values)

    def drop(self, batch: Batch) -> None:
        """Throw `batch` away untrained (rejection sampling): its samples are released, the ledger
        never lists it, its stats are not in the step's row. Its prompts are used up."""
        cur = self._current("drop")
        if batch not in cur.batches:
            raise LoopError("drop(): the batch is not one of this step's")
        cur.batches.remove(batch)
        self.master.release(ids=batch.ids)
