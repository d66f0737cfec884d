# A reward and an MFC of your own, in one file that the experiment's `imports:` names.
import pydantic
from realcore.api.data import SequenceSample
from realcore.api.registry import MFCSpec, register_mfc, register_reward


@register_reward("exact")  # AReaL's signature; `data` holds the row's other fields (question, ...)
def exact(prompt, completion, prompt_ids, completion_ids, *, answer, **data) -> float:
    return float(completion.strip() == answer.strip())


@register_mfc("length_penalty")  # reward - coef x response length, for the update to train on
class LengthPenalty:
    spec = MFCSpec(needs_model=False)  # runs without a model

    class Args(pydantic.BaseModel):  # the node's `args:`, checked when the graph is built
        model_config = pydantic.ConfigDict(extra="forbid")
        coef: float = 0.01

    def __init__(self, cfg, mfc):
        self.args = self.Args(**mfc.args)

    def run(self, model, batch: SequenceSample):
        lens = [float(m.sum()) for m in batch.flat("loss_mask")]
        shaped = [r - self.args.coef * n for r, n in zip(batch.flat("task_rewards"), lens)]
        stats = {"penalty/mean_len": sum(lens) / len(lens), "penalty/shaped_mean": sum(map(float, shaped)) / len(lens)}
        return SequenceSample.from_flat(batch.ids, batch.group_sizes("loss_mask"), {"rewards": shaped}), stats
