"""Step metrics: one JSON object per step in metrics.jsonl, TensorBoard scalars, a console line,
and optionally a Weights & Biases run (logging.wandb)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time

from realcore.api.config import ExperimentConfig
from realcore.trainer.recover import truncate_jsonl

log = logging.getLogger("realcore.metrics")

# Deadlines of the W&B calls that wait on its server (wandb's defaults: init 90 s, finish unbounded);
# data not yet sent at finish stays under OUTPUT_DIR/wandb for `wandb sync`.
WANDB_INIT_TIMEOUT_S = 60.0
WANDB_FINISH_TIMEOUT_S = 60.0


def wandb_init_kwargs(cfg: ExperimentConfig) -> dict | None:
    """wandb.init's arguments for this run, or None when W&B logging is off. `config` is the resolved
    config without rollout.server_token (a credential of the run's generation servers)."""
    w = cfg.logging.wandb
    if w.project is None:
        return None
    config = cfg.model_dump(mode="json")
    if config["rollout"]["server_token"] is not None:
        config["rollout"]["server_token"] = "<redacted>"
    return dict(project=w.project, entity=w.entity, name=w.name or f"{cfg.experiment_name}/{cfg.trial_name}",
                group=w.group, tags=list(w.tags), mode=w.mode, config=config)


def wandb_run_id(output_dir: str, resume_step: int) -> str:
    """The W&B run id of the run in `output_dir`, kept in OUTPUT_DIR/wandb/run_id: a resumed run
    continues the same W&B run; a run started over from step 0 gets a new one, because W&B drops
    rows whose step is not above the last it holds (the new run's steps would all be lost)."""
    path = os.path.join(output_dir, "wandb", "run_id")
    if resume_step > 0 and os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    seed = os.path.abspath(output_dir) + (f":{time.time_ns()}" if resume_step == 0 else "")
    run_id = hashlib.sha256(seed.encode()).hexdigest()[:16]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id


def start_wandb(output_dir: str, resume_step: int, init: dict):
    """A W&B run, or None (one warning) when wandb is missing or fails: the run goes on without it. An
    unreachable server holds the first step up to WANDB_INIT_TIMEOUT_S (then wandb gives up)."""
    try:
        import wandb  # lazily: an optional dependency

        settings = wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S, finish_timeout=WANDB_FINISH_TIMEOUT_S)
        return wandb.init(**init, id=wandb_run_id(output_dir, resume_step), resume="allow", dir=output_dir,
                          settings=settings)
    except Exception as e:  # wandb raises many types (no API key, server unreachable, timeout)
        log.warning("wandb: not logging this run: %s: %s", type(e).__name__, " ".join(str(e).split()))
        return None


def add_throughput(metrics: dict, gen_s: float, train_s: float) -> None:
    """perf/gen_tokens_per_s: the step's response tokens (gen/response_tokens) over `gen_s`, the time
    generation had (sync: its MFC's; async: the step's, generation running beside training);
    perf/train_tokens_per_s: the tokens the policy's update ran (train/tokens) over its time."""
    if "gen/response_tokens" in metrics and gen_s > 0:
        metrics["perf/gen_tokens_per_s"] = metrics["gen/response_tokens"] / gen_s
    if "train/tokens" in metrics and train_s > 0:
        metrics["perf/train_tokens_per_s"] = metrics["train/tokens"] / train_s


class TensorBoardScalars:
    """Scalars in TensorBoard's event files, through tensorboard's own writer: torch's SummaryWriter
    writes the same events around it, but importing it costs a process that needs no torch (the
    master) ~2 s of CPU. `purge_step` as SummaryWriter's: TensorBoard hides the events of that step
    and later ones written before (by an attempt that failed)."""

    def __init__(self, log_dir: str, purge_step: int | None = None):
        # Here: tensorboard pulls in protobuf (~0.3 s), paid only by the process that writes the scalars.
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(log_dir)
        if purge_step is not None:
            self._writer.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            self._writer.add_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        """A step's scalars as one event (a summary holds many values; an event each cost the master
        ~30 us per metric)."""
        summary = self._summary(value=[self._summary.Value(tag=t, simple_value=float(v)) for t, v in values.items()])
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    def __init__(self, output_dir: str, total_steps: int, *, resume_step: int = 0, wandb_init: dict | None = None):
        """A new run starts a new record; a resumed one continues after `resume_step`: rows of
        later steps (written by the attempt that failed) are dropped, and TensorBoard hides its
        events from those steps (purge_step), so every step appears once. `wandb_init`
        (wandb_init_kwargs) also logs every row to a W&B run."""
        self.total = total_steps
        self.path = os.path.join(output_dir, "metrics.jsonl")
        # Rows after the checkpoint (all of them from step 0) are the failed attempt's; the launcher
        # refuses a fresh run into another run's records (run_lock.claim_output), so none are its.
        truncate_jsonl(self.path, resume_step)
        self._file = open(self.path, "a", buffering=1)
        self._tb = TensorBoardScalars(os.path.join(output_dir, "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
        self._live = sys.stdout.isatty()
        self._wandb = start_wandb(output_dir, resume_step, wandb_init) if wandb_init is not None else None

    def live(self, step: int, what: str) -> None:
        """Overwrite the console's last line with what is running now (terminals only)."""
        if self._live:
            sys.stdout.write(f"\r\033[Kstep {step}/{self.total} | {what}")
            sys.stdout.flush()

    def write(self, metrics: dict) -> None:
        step = metrics["step"]
        self._file.write(json.dumps(metrics, sort_keys=True) + "\n")
        self._tb.add_scalars({k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}, step)
        self._tb.flush()
        if self._wandb is not None:
            self._log_wandb(metrics)
        print(("\r\033[K" if self._live else "") + self.console_line(metrics), flush=True)

    def _log_wandb(self, metrics: dict) -> None:
        """The numbers TensorBoard gets. W&B keeps a step's first row: on resume, steps the failed
        attempt logged after its checkpoint keep that attempt's values there (metrics.jsonl has the new)."""
        try:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))},
                            step=metrics["step"])
        except Exception as e:
            log.warning("wandb: stopped logging this run: %s: %s", type(e).__name__, " ".join(str(e).split()))
            self._wandb = None

    def console_line(self, m: dict) -> str:
        parts = [f"step {m['step']}/{self.total}"]
        if "reward/mean" in m:
            parts.append(f"reward {m['reward/mean']:.3f}")
        if "loss" in m:
            parts.append(f"loss {m['loss']:.4f}")
        if "eval/accuracy" in m:
            parts.append(f"eval accuracy {m['eval/accuracy']:.3f}")
        times = [f"{k[5:-2]} {v:.1f}s" for k, v in m.items() if k.startswith("time/") and k != "time/step_s"]
        parts.append(" ".join(times))
        parts.append(f"{m['time/step_s']:.1f}s/step")
        return " | ".join(parts)

    def close(self) -> None:
        self._file.close()
        self._tb.close()
        run, self._wandb = self._wandb, None
        if run is not None:
            try:
                run.finish()
            except Exception as e:
                log.warning("wandb: finish failed (the data is under the run's wandb/ folder; `wandb sync` uploads "
                            "it): %s: %s", type(e).__name__, " ".join(str(e).split()))


def print_reward_summary(metrics_path: str) -> None:
    """Mean reward of the first and last steps of the whole run (across restarts: from the file),
    and held-out accuracy before training and after the last step (when evaluation is on)."""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    rewards = [m["reward/mean"] for m in rows if "reward/mean" in m]
    if rewards:
        k = max(1, min(5, len(rewards) // 2))
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        print(f"reward/mean: first {k} steps {first:.3f}, last {k} steps {last:.3f} ({last - first:+.3f})", flush=True)
    evals = [m for m in rows if "eval/accuracy" in m]
    if len(evals) >= 2:
        a, b = evals[0], evals[-1]
        print(f"held-out accuracy (greedy, {int(b.get('eval/n_prompts', 0))} prompts): step {a['step']} "
              f"{a['eval/accuracy']:.3f}, step {b['step']} {b['eval/accuracy']:.3f} "
              f"({b['eval/accuracy'] - a['eval/accuracy']:+.3f})", flush=True)
