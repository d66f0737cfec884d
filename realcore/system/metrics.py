"""Step metrics: one JSON object per step in metrics.jsonl, TensorBoard scalars, a console line."""

from __future__ import annotations

import json
import os
import sys


class MetricsWriter:
    def __init__(self, output_dir: str, total_steps: int, *, resume_step: int = 0):
        """A new run starts a new record; a resumed one continues after `resume_step`: rows of
        later steps (written by the attempt that failed) are dropped, and TensorBoard hides its
        events from those steps (purge_step), so every step appears once."""
        from realcore.system.recover import truncate_jsonl

        self.total = total_steps
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if resume_step == 0 and os.path.exists(self.path):
            os.remove(self.path)
        truncate_jsonl(self.path, resume_step)
        self._file = open(self.path, "a", buffering=1)
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
        self._live = sys.stdout.isatty()

    def live(self, step: int, what: str) -> None:
        """Overwrite the console's last line with what is running now (terminals only)."""
        if self._live:
            sys.stdout.write(f"\r\033[Kstep {step}/{self.total} | {what}")
            sys.stdout.flush()

    def write(self, metrics: dict) -> None:
        step = metrics["step"]
        self._file.write(json.dumps(metrics, sort_keys=True) + "\n")
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, step)
        self._tb.flush()
        print(("\r\033[K" if self._live else "") + self.console_line(metrics), flush=True)

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
