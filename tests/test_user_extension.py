"""A researcher's own MFC and reward, from one Python file and their own experiment YAML, run end to
end through the launcher without touching realcore (the README's example)."""

import json
import os
import subprocess
import sys
import textwrap

MY_MFCS = textwrap.dedent('''
    import pydantic
    import torch
    from realcore.api.data import SequenceSample
    from realcore.api.registry import MFCSpec, register_mfc, register_reward

    @register_reward("exact")
    def exact(prompt, completion, prompt_ids, completion_ids, *, answer, **data) -> float:
        return float(completion.strip() == answer.strip())

    @register_mfc("length_penalty")
    class LengthPenalty:
        spec = MFCSpec(needs_model=False)
        class Args(pydantic.BaseModel):  # its `args:` in the YAML, checked when the graph is built
            model_config = pydantic.ConfigDict(extra="forbid")
            coef: float = 0.01
        def __init__(self, cfg, mfc):
            self.args = self.Args(**mfc.args)
        def run(self, model, batch: SequenceSample):
            lens = [float(m.sum()) for m in batch.flat("loss_mask")]
            out = [torch.tensor([-self.args.coef * n]) for n in lens]
            return SequenceSample.from_flat(batch.ids, batch.group_sizes("loss_mask"), {"penalty": out}), {
                "penalty/mean": float(torch.cat(out).mean()), "penalty/mean_len": sum(lens) / len(lens)}
''')

MY_EXPERIMENT = textwrap.dedent('''
    # @package _global_
    defaults:
      - ppo-math
    experiment_name: mine
    imports: [my_mfcs]
    reward: {type: exact}
    mfcs:
      - {name: actor_gen, type: generate, model: actor, inputs: [prompt_ids], outputs: [input_ids, loss_mask, behav_logprobs]}
      - {name: reward, type: reward, inputs: [input_ids, loss_mask, answer], outputs: [rewards]}
      - {name: penalty, type: length_penalty, inputs: [loss_mask], outputs: [penalty], args: {coef: 0.5}}
      - {name: ref_inf, type: inference, model: ref, inputs: [input_ids], outputs: [logprobs], output_remap: {logprobs: ref_logprobs}}
      - {name: actor_train, type: ppo_update, model: actor, inputs: [input_ids, loss_mask, behav_logprobs, rewards, ref_logprobs]}
''')


def test_user_mfc_from_own_file_and_yaml(tmp_path):
    (tmp_path / "my_mfcs.py").write_text(MY_MFCS)
    (tmp_path / "my_experiments" / "experiment").mkdir(parents=True)
    (tmp_path / "my_experiments" / "experiment" / "mine.yaml").write_text(MY_EXPERIMENT)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "realcore.launch", f"hydra.searchpath=[file://{tmp_path}/my_experiments]", "experiment=mine",
           "model=tiny", "trainer.total_steps=2", "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=6",
           f"output_dir={out}", f"model.cache_dir={tmp_path}/cache", f"system.name_resolve.root={tmp_path}/nr"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "penalty [length_penalty on -]: loss_mask -> penalty" in r.stdout
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert len(metrics) == 2 and all(m["penalty/mean"] < 0 and "time/penalty_s" in m for m in metrics)
    assert all(abs(m["penalty/mean"] + 0.5 * m["penalty/mean_len"]) < 1e-6 for m in metrics)  # args.coef used
    for override, message in (("mfcs.2.args.coef=lots", "mfcs[2] (penalty).args.coef: Input should be a valid number"),
                              ("+mfcs.2.args.coeff=1", "mfcs[2] (penalty).args.coeff: Extra inputs are not permitted"),
                              ("+mfcs.1.args.coef=1", "mfcs[1] (reward).args: MFC type 'reward' declares no Args model")):
        r = subprocess.run(cmd + [override], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": ""})
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr[-2000:]
