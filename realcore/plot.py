"""Pictures of a run: `python -m realcore.plot OUTPUT_DIR` writes OUTPUT_DIR/curves.png from its
metrics.jsonl (the master also writes it at the end of every run).

One panel per figure people look at before they read numbers, each against the step: training
reward, held-out accuracy (when evaluation is on), entropy, KL (to the reference, or between the
behaviour and the trained policy), staleness head/tail (async), time per step. Panels whose metrics
the run does not have are left out.
"""

from __future__ import annotations

import json
import os
import sys

# (title, [(metric, label), ...])
PANELS = [
    ("training reward", [("reward/mean", "mean reward")]),
    ("held-out evaluation", [("eval/accuracy", "greedy accuracy"), ("eval/reward", "greedy reward")]),
    ("entropy", [("ppo/entropy", "policy entropy")]),
    ("KL", [("ppo/kl", "KL(actor || ref)"), ("ppo/approx_kl", "KL(behaviour || actor)")]),
    ("staleness (versions)", [("staleness/head", "head"), ("staleness/tail", "tail")]),
    ("time per step (s)", [("time/step_s", "step"), ("time/stream_wait_s", "waiting for trajectories")]),
]


def read_metrics(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except ValueError:  # a line cut by a crash: the rest is still worth a picture
                    continue
    return rows


def plot_run(output_dir: str) -> str:
    """Write OUTPUT_DIR/curves.png; returns its path. ValueError when there is nothing to plot."""
    import matplotlib  # heavy: only when curves are drawn (the master, once, at the end)

    matplotlib.use("Agg")  # before pyplot is imported: no display on a cluster node
    import matplotlib.pyplot as plt

    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ValueError(f"{output_dir}: no metrics.jsonl (not a realcore run directory, or no step finished)")
    rows = read_metrics(path)
    panels = []
    for title, series in PANELS:
        lines = []
        for key, label in series:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
            if pts:
                lines.append((label, pts))
        if lines:
            panels.append((title, lines))
    if not panels:
        raise ValueError(f"{path}: no step has any of the plotted metrics")
    cols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.2 * nrows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels):
        for label, pts in lines:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(os.path.basename(os.path.abspath(output_dir)))
    fig.tight_layout()
    out = os.path.join(output_dir, "curves.png")
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)  # a reader never sees half a picture
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        print(plot_run(argv[0]))
    except (ValueError, OSError) as e:
        print(f"realcore.plot: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
