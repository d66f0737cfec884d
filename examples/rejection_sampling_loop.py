"""Rejection sampling of whole batches, which the YAML graph cannot express: a batch whose mean
reward is outside (low, high) is thrown away untrained, and another is drawn, up to `tries` times
per step. When every answer is right, or every one wrong, the group-normalised advantages are all 0,
and such a batch only costs an update.

    python examples/rejection_sampling_loop.py model=tiny trainer.total_steps=5

Each step's metrics row counts the batches thrown away (rejected/batches). A thrown-away batch is
released and never reaches the ledger, and its prompts are used up.
"""

import os

from realcore import Controller

# The script's own knobs, from the environment (the command line holds config overrides only).
LOW = float(os.environ.get("REJECT_LOW", "0.0"))
HIGH = float(os.environ.get("REJECT_HIGH", "1.0"))
TRIES = int(os.environ.get("REJECT_TRIES", "4"))

ctl = Controller(experiment="ppo-math")

for step in ctl.steps():
    for attempt in range(TRIES):
        batch = ctl.rollout()  # prompts, responses and rewards (the generate MFC)
        if LOW < batch.stats["reward/mean"] < HIGH or attempt == TRIES - 1:
            break  # a batch to learn from (or the last try: train on it anyway)
        ctl.drop(batch)
    ctl.log(**{"rejected/batches": attempt})

    if "ref_inf" in ctl.mfc_names:
        ctl.call("ref_inf", batch)
    train = ctl.call("actor_train", batch)
    print(f"step {step}: kept a batch of reward {batch.stats['reward/mean']:.3f} after {attempt} rejected; "
          f"loss {train['loss']:.4f}", flush=True)
