"""The typed MFC spec (realcore.api.registry.MFCSpec): what the graph checks from it, and the LR
schedule it sizes for a user's training MFC that makes several optimizer steps per call."""

from __future__ import annotations

import pytest
import torch

from realcore.api.config import MFCConfig, OptimizerConfig
from realcore.api.data import SequenceSample
from realcore.api.registry import MFCSpec, dataset_keys, mfc_spec, register_mfc
from realcore.backends.torch_engine import TorchEngine
from realcore.dfg.graph import GraphError, build_graph
from realcore.launch.config_loader import load_config
from realcore.trainer.model_worker import optimizer_steps
from tests.test_torch_engine import make_data, model_dir, n_loss_tokens, nll_loss  # noqa: F401 (model_dir: fixture)

torch.set_num_threads(1)

STEPS_PER_CALL = 3


@register_mfc("test_spec_three_steps")
class ThreeSteps:
    """A user's training MFC: each call makes three optimizer steps (three minibatches)."""

    spec = MFCSpec(trains=True, optimizer_steps=STEPS_PER_CALL)

    def __init__(self, cfg, mfc):
        pass

    def run(self, model, batch: SequenceSample):
        data = {k: batch.flat(k) for k in ("input_ids", "loss_mask")}
        return model.train_batch(data, nll_loss, n_loss_tokens, n_minibatches=STEPS_PER_CALL)


@register_mfc("test_spec_value_reader")
class ValueReader:
    spec = MFCSpec(head="value")

    def __init__(self, cfg, mfc):
        pass


@register_mfc("test_spec_not_a_spec")
class NotASpec:
    spec = {"trains": True}


def _cfg(*overrides):
    return load_config(["experiment=ppo-math", "model=tiny", "output_dir=/tmp/heads-unused", *overrides])


def test_a_user_mfc_making_three_steps_per_call_ends_its_cosine_schedule_at_the_runs_last_step(model_dir):  # noqa: F811
    total_steps = 6
    cfg = _cfg(f"trainer.total_steps={total_steps}")
    mfc = MFCConfig(name="train", type="test_spec_three_steps", model="actor", inputs=["input_ids", "loss_mask"])
    cfg = cfg.model_copy(update={"mfcs": [mfc]})
    assert optimizer_steps(cfg, "actor") == total_steps * STEPS_PER_CALL
    opt = OptimizerConfig(lr=1e-3, lr_scheduler="cosine", warmup_steps=0, min_lr_ratio=0.1)
    role = cfg.actor.model_copy(update={"optimizer": opt, "dtype": "float32", "trainable": True})
    engine = TorchEngine(model_dir, role, total_steps=optimizer_steps(cfg, "actor"))
    lrs: list[float] = []
    engine.optimizer.register_step_pre_hook(lambda *_: lrs.append(engine.optimizer.param_groups[0]["lr"]))
    user = ThreeSteps(cfg, mfc)
    for step in range(total_steps):
        data = make_data([5, 6, 7, 8, 9, 4], seed=step)
        batch = SequenceSample(list(range(6)), [{k: [v[i]] for k, v in data.items()} for i in range(6)])
        user.run(engine, batch)
    min_lr = opt.lr * opt.min_lr_ratio
    assert len(lrs) == total_steps * STEPS_PER_CALL
    assert engine.scheduler.get_last_lr()[0] == pytest.approx(min_lr)  # after the run's last step: the minimum
    assert lrs[-1] > min_lr  # ... and not before it
    third = lrs[total_steps - 1]  # the last step of the first third of the run
    assert third - min_lr > 0.6 * (opt.lr - min_lr), lrs  # cosine at 1/3: 75% of the way above the minimum


def test_ppo_update_spec_sizes_its_steps_from_the_ppo_section():
    cfg = _cfg("trainer.total_steps=7", "ppo.ppo_n_minibatches=2", "ppo.ppo_epochs=3")
    spec = mfc_spec("ppo_update")
    assert spec.trains and spec.micro_batches and spec.head == "policy"
    assert spec.steps_per_call(cfg, cfg.mfcs[-1]) == 6
    assert optimizer_steps(cfg, "actor") == 42 and optimizer_steps(cfg, "ref") == 7  # ref: no training MFC
    assert mfc_spec("generate").generates and not mfc_spec("reward").needs_model and mfc_spec("inference").micro_batches


def test_the_graph_checks_the_head_an_mfc_needs():
    cfg = _cfg()
    cfg = cfg.model_copy(update={"ref": cfg.ref.model_copy(update={"head": "value"})})
    with pytest.raises(GraphError, match=r"mfcs\[1\] \(ref_inf\)\.model: 'inference' needs a role with head: policy, "
                                         r"but role 'ref' has head: value"):
        build_graph(cfg, dataset_keys(cfg.dataset))
    cfg = _cfg()
    mfcs = list(cfg.mfcs) + [MFCConfig(name="read", type="test_spec_value_reader", model="ref", inputs=["input_ids"])]
    with pytest.raises(GraphError, match=r"\(read\)\.model: 'test_spec_value_reader' needs a role with head: value"):
        build_graph(cfg.model_copy(update={"mfcs": mfcs}), dataset_keys(cfg.dataset))


def test_a_spec_that_is_not_an_mfcspec_is_one_graph_error():
    cfg = _cfg()
    mfcs = list(cfg.mfcs) + [MFCConfig(name="bad", type="test_spec_not_a_spec", model="actor", inputs=["input_ids"])]
    with pytest.raises(GraphError, match=r"\(bad\)\.type: MFC 'test_spec_not_a_spec': spec must be"):
        build_graph(cfg.model_copy(update={"mfcs": mfcs}), dataset_keys(cfg.dataset))


def test_the_old_duck_typed_attributes_are_gone():
    from realcore.mfc.generate import Generate
    from realcore.mfc.inference import Inference
    from realcore.mfc.reward import Reward
    from realcore.mfc.train import PPOUpdate, SFTUpdate

    for cls in (Generate, Inference, Reward, PPOUpdate, SFTUpdate):
        assert isinstance(cls.spec, MFCSpec)
        assert not any(hasattr(cls, a) for a in ("needs_model", "trains", "generates", "micro_batches")), cls
