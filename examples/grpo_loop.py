"""GRPO on math, the RL loop written out in one file: what `python -m realcore.launch
experiment=ppo-math` runs from its YAML graph, as Python you can edit and step through.

    python examples/grpo_loop.py model=tiny trainer.total_steps=5

The command line takes the launcher's `key=value` overrides. `Controller()` starts the same
workers the launcher would (the scheduler, recovery and checkpoints as configured). The loop
below runs in the run's master process. Each `ctl.call(NAME, batch)` runs one MFC of the
experiment's graph on the model workers; a batch holds sample ids only, and the tensors stay on the
workers. A `breakpoint()` anywhere in the loop stops the run while you look: the workers' heartbeats go on.
"""

from realcore import Controller

# Started by you: composes and checks the config, starts the workers and this file again as the
# run's master, watches them, exits with the launcher's exit code. In the master: the loop's verbs.
ctl = Controller(experiment="ppo-math")
cfg = ctl.cfg
print(f"MFCs of the graph: {', '.join(ctl.mfc_names)}; {cfg.trainer.total_steps} steps of "
      f"{cfg.trainer.batch_size} prompts x {cfg.generation.n_samples} samples", flush=True)

# The steps left to run: from the step after the last recover checkpoint (a restarted run goes on
# where it stopped). A step ends when the next one is asked for: its metrics row (metrics.jsonl,
# TensorBoard), the ledger's rows, and the checkpoints the config asks for are written then.
for step in ctl.steps():
    # trainer.batch_size prompts from the dataset, generation.n_samples responses each, scored by
    # the reward function (the generate MFC, actor_gen, runs the rollout workflow).
    batch = ctl.rollout()

    # The reference policy's log-probs, for the KL penalty (ppo.kl_coef).
    if "ref_inf" in ctl.mfc_names:  # the launcher drops it when nothing reads its output (kl_coef=0)
        ctl.call("ref_inf", batch)

    # Group-normalised advantages and the PPO update of the policy (ppo.*, actor.optimizer.*).
    train = ctl.call("actor_train", batch)

    # Generation servers get the new policy (none here: generation is colocated with training).
    ctl.update_weights()

    # Held-out accuracy every eval.freq_steps steps (the step's end would run it anyway).
    if cfg.eval.freq_steps and (step % cfg.eval.freq_steps == 0 or step == cfg.trainer.total_steps):
        ctl.evaluate()

    # Anything of the script's own goes into the step's metrics row.
    ctl.log(**{"script/reward_x_entropy": batch.stats["reward/mean"] * train["ppo/entropy"]})

    print(f"step {step}: reward {batch.stats['reward/mean']:.3f}  loss {train['loss']:.4f}  "
          f"policy version {ctl.version}", flush=True)
