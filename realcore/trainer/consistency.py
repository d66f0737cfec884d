"""Warnings on train/inference drift (issue 44, part 8): the step's consistency figures, written by
ppo_update (realcore/mfc/consistency_stats.py), against the thresholds of the `ppo:` section."""

from __future__ import annotations

from typing import Any

# figure -> the PPOConfig field holding its threshold
THRESHOLDS = {
    "consistency/logprob_gap_mean": "warn_logprob_gap_mean",
    "consistency/logprob_gap_p99": "warn_logprob_gap_p99",
    "consistency/logprob_gap_max": "warn_logprob_gap_max",
    "consistency/version_span": "warn_version_span",
}


def drift_warnings(metrics: dict[str, Any], cfg: Any) -> list[str]:
    """One line per figure of `metrics` past its threshold in `cfg.ppo` (a threshold of None: not watched).
    A figure the step does not hold (no training, sync mode's version span) warns of nothing."""
    lines = []
    for key, field in THRESHOLDS.items():
        limit = getattr(cfg.ppo, field)
        value = metrics.get(key)
        if limit is not None and value is not None and float(value) > limit:
            why = ("the trainer's log-probs drift from the sampler's" if key != "consistency/version_span"
                   else "the trained sequences span that many policy versions")
            lines.append(f"{key} = {float(value):.4g} exceeds ppo.{field} = {limit:g}: {why}")
    return lines
