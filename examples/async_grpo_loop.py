"""Asynchronous PPO (AReaL's), the RL loop written out in one file: what `python -m realcore.launch
experiment=async-ppo-math` runs from its YAML graph.

    python examples/async_grpo_loop.py model=tiny trainer.total_steps=5

Rollout workers keep generating on the generation servers while this loop trains. `ctl.rollout()`
takes the first trainer.batch_size groups that reach the trainer. A group staler than
rollout.max_head_offpolicyness versions is dropped, and so is a prompt trained already. The ledger
(OUTPUT_DIR/ledger.jsonl) shows both rules held. With recover_mode=auto, a dead model worker
restarts the run, this file included; `ctl.steps()` then goes on after the last recover checkpoint.
"""

from realcore import Controller

ctl = Controller(experiment="async-ppo-math")

for step in ctl.steps():
    # Trajectories already generated (by policy versions up to the bound behind this one): tokens,
    # behaviour log-probs, rewards, and the versions that produced them (version_start/end).
    batch = ctl.rollout()

    # The current policy's log-probs: the proximal policy of the decoupled PPO objective.
    ctl.call("actor_inf", batch)

    # The PPO update: importance weights behaviour -> proximal, clipping around the proximal.
    train = ctl.call("actor_train", batch)

    # The servers get the new weights: in-flight generations are interrupted, the weights loaded,
    # and they resume (rollout.weight_update: disk, memory or nccl).
    ctl.update_weights()

    print(f"step {step}: reward {batch.stats['reward/mean']:.3f}  staleness head {batch.stats['staleness/head']}  "
          f"loss {train['loss']:.4f}", flush=True)
