"""One YAML per algorithm builds its config and graph; a user's estimator and loss are one decorated
function each in an `imports:` file, named in the update's args; ppo_update wires them to the engine
(through a stand-in for the engine's train_batch: it stands in for the engine's packing and policy head
only), with its consistency figures."""

import math

import pytest
import torch

from realcore.api.data import SequenceSample
from realcore.api.engine import HeadOutput
from realcore.api.registry import source_keys
from realcore.dfg.graph import GraphError, build_graph
from realcore.launch.config_loader import import_user_modules, load_config
from realcore.mfc.train import PPOUpdate
from realcore.trainer.consistency import drift_warnings

torch.set_num_threads(1)

ALGORITHMS = {  # experiment -> (advantage, policy_loss, loss_agg)
    "grpo-math": ("grpo", "ppo-clip", "seq-mean-token-mean"),
    "dr-grpo-math": ("dr-grpo", "ppo-clip", "seq-mean-token-sum"),
    "rloo-math": ("rloo", "ppo-clip", "token-mean"),
    "reinforce-pp-math": ("reinforce++", "ppo-clip", "token-mean"),
    "reinforce-pp-baseline-math": ("reinforce++-baseline", "ppo-clip", "token-mean"),
    "dapo-math": ("grpo", "ppo-clip", "token-mean"),
    "gspo-math": ("grpo", "gspo", "seq-mean-token-mean"),
    "cispo-math": ("grpo", "cispo", "token-mean"),
    "sapo-math": ("grpo", "sapo", "seq-mean-token-mean"),
    "grpo-tis-math": ("grpo", "ppo-clip", "token-mean"),
}


def load(*overrides):
    cfg = load_config(["output_dir=/tmp/algo-unused", *overrides])
    import_user_modules(cfg)
    return cfg


def update_of(cfg):
    node = next(m for m in cfg.mfcs if m.type == "ppo_update")
    return node, PPOUpdate(cfg, node)


@pytest.mark.parametrize("experiment", sorted(ALGORITHMS))
def test_each_algorithm_yaml_builds_its_config_and_graph(experiment):
    cfg = load(f"experiment={experiment}", "model=tiny")
    dfg = build_graph(cfg, source_keys(cfg))
    assert dfg.order()[0] == "actor_gen" and dfg.order()[-1] == "actor_train"
    _, u = update_of(cfg)
    assert (u.args.advantage, u.args.policy_loss, u.args.loss_agg) == ALGORITHMS[experiment]
    if experiment == "dapo-math":
        assert (u.args.eps_clip, u.args.eps_clip_high, u.args.overlong_buffer) == (0.2, 0.28, 4)
    if experiment == "grpo-tis-math":
        assert u.args.off_policy == "tis"


def test_async_ppo_math_reads_the_versions_for_the_version_span():
    cfg = load("experiment=async-ppo-math", "model=tiny")
    dfg = build_graph(cfg, source_keys(cfg))
    assert {"version_start", "version_end"} <= set(dfg.nodes["actor_train"].inputs)


def test_ppo_math_without_args_keeps_the_ppo_section():
    cfg = load("experiment=ppo-math", "ppo.eps_clip=0.15", "ppo.adv_norm=batch", "ppo.c_clip=3")
    _, u = update_of(cfg)
    a = u.args
    assert (a.advantage, a.policy_loss, a.loss_agg, a.off_policy) == ("grpo", "ppo-clip", "token-mean", "none")
    assert (a.eps_clip, a.eps_clip_high, a.adv_norm, a.c_clip) == (0.15, None, "batch", 3.0)


@pytest.mark.parametrize("args, message", [
    ({"advantage": "nope"}, "args.advantage: unknown advantage 'nope'"),
    ({"policy_loss": "nope"}, "args.policy_loss: unknown policy loss 'nope'"),
    ({"loss_agg": "sum"}, "args.loss_agg"),
    ({"kl_in_reward": 0.1}, "ppo_update reads ['ref_logprobs'] (args.kl_in_reward > 0)"),
    ({"overlong_buffer": 999}, "args.overlong_buffer: 999 exceeds generation.max_new_tokens"),
    ({"eps_clp": 0.1}, "args.eps_clp"),
    ({"off_policy": "tis"}, "args.off_policy: not with ppo.use_decoupled_loss"),
])
def test_bad_args_are_one_line_graph_errors(args, message):
    cfg = load("experiment=async-ppo-math", "model=tiny")  # decoupled PPO, no reference model
    assert cfg.mfcs[1].type == "ppo_update"
    cfg.mfcs[1].args = args
    with pytest.raises(GraphError) as e:
        build_graph(cfg, source_keys(cfg))
    assert message in str(e.value) and "\n" not in str(e.value)


USER = '''
import torch
from realcore.api.algorithms import AdvantageOutputs, register_advantage, register_policy_loss

CALLS = []

@register_advantage("always-one")
def always_one(inputs):
    CALLS.append("advantage")
    return AdvantageOutputs([m.float() * inputs.args.params["scale"] for m in inputs.loss_mask])

@register_policy_loss("plain-pg")
def plain_pg(inputs):
    CALLS.append("loss")
    return -inputs.advantages * inputs.logprobs, {"my_stat": inputs.logprobs.detach().mean()}
'''


class FakeEngine:
    """Stands in for an engine's train_batch (one micro-batch, one optimizer step) and its policy head: the
    log-probs are a leaf tensor, so the test reads the gradient the loss gives them."""

    def __init__(self, logprobs):
        self.lp, self.version, self.grads, self.logprob_calls = logprobs, 0, [], 0

    def logprobs(self, input_ids, temperature=1.0, *, max_tokens_per_mb=None):
        self.logprob_calls += 1
        return [x.clone() for x in self.lp]

    def train_batch(self, data, loss_fn, loss_weight_fn, *, n_minibatches=1, temperature=1.0, max_tokens_per_mb=None,
                    group_sizes=None):
        lens = [len(x) for x in data["input_ids"]]
        packed = {k: torch.cat(v) for k, v in data.items()}
        packed["cu_seqlens"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        lp = torch.cat(self.lp).clone().requires_grad_(True)
        loss, stats = loss_fn(HeadOutput(packed["cu_seqlens"], logprobs=lp, entropy=torch.zeros_like(lp)), packed)
        loss.backward()
        self.grads.append(lp.grad)
        self.version += 1
        return {k: float(v) for k, v in stats.items()}


def batch(version_start=None, version_end=None):
    """Two prompts, two sequences each: [prompt, prompt, response...]."""
    seqs = [torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 5]), torch.tensor([6, 7, 8]), torch.tensor([6, 7, 9, 9])]
    masks = [torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1, 1])]
    behav = [torch.full((len(s),), -1.0) * m for s, m in zip(seqs, masks)]
    data = {"input_ids": seqs, "loss_mask": masks, "behav_logprobs": behav,
            "rewards": [torch.tensor([r]) for r in (1.0, 0.0, 0.0, 0.0)]}
    if version_start is not None:
        data["version_start"] = [torch.tensor([v]) for v in version_start]
        data["version_end"] = [torch.tensor([v]) for v in version_end or [v + 1 for v in version_start]]
    return SequenceSample.from_flat([0, 1], [2, 2], data)


def test_a_users_estimator_and_loss_are_one_decorated_function_each(tmp_path, monkeypatch):
    (tmp_path / "my_algo.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load("experiment=dapo-math", "imports=[my_algo]")
    cfg.mfcs[1].args = {"advantage": "always-one", "policy_loss": "plain-pg", "params": {"scale": 2.0}}
    build_graph(cfg, source_keys(cfg))  # the names resolve when the graph is built
    import my_algo

    _, u = update_of(cfg)
    b = batch()
    engine = FakeEngine([torch.full((len(x),), -0.5) for x in b.flat("input_ids")])
    stats = u.run(engine, b)
    assert my_algo.CALLS == ["advantage", "loss"]
    # loss = token mean of -A logp with A = 2 on the 6 response tokens: gradient -2/6 there, 0 on the prompt
    mask = torch.cat(b.flat("loss_mask")).bool()
    assert torch.allclose(engine.grads[0][mask], torch.full((6,), -2.0 / 6))
    assert torch.all(engine.grads[0][~mask] == 0)
    assert stats["ppo/my_stat"] == pytest.approx(-0.5)  # the loss's own stats are logged under ppo/
    # consistency: |behav - recomputed| = |-1 - (-0.5)| on every trained token; sync: no version span
    assert stats["consistency/logprob_gap_mean"] == pytest.approx(0.5)
    assert stats["consistency/logprob_gap_max"] == pytest.approx(0.5)
    assert "consistency/version_span" not in stats


def test_ppo_update_reports_version_span_and_tis_recomputes_once():
    cfg = load("experiment=grpo-tis-math", "model=tiny", "ppo.kl_coef=0")
    _, u = update_of(cfg)
    b = batch(version_start=[3, 3, 5, 6], version_end=[4, 4, 5, 6])
    lp = [torch.tensor([0.0, 0.0, -4.0, -4.0]), torch.tensor([0.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, -1.5]),
          torch.tensor([0.0, 0.0, -1.0, -3.0])]  # the last: one token 2 nats from its behaviour log-prob
    engine = FakeEngine(lp)
    engine.version = 6
    stats = u.run(engine, b)
    assert engine.logprob_calls == 1  # the recomputed log-probs of the weights that sampled
    assert stats["consistency/version_span"] == 6 - 3
    # The gap counts only the sequence sampled wholly by the weights the trainer holds (version 6): the
    # others' gaps (3 nats, 0.5 nats) are staleness, which version_span reports.
    assert stats["consistency/logprob_gap_max"] == pytest.approx(2.0)
    assert stats["consistency/logprob_gap_mean"] == pytest.approx(2.0 / 2)
    # weights w = exp(recomputed - behav) below 1 are not truncated (TIS truncates above C only): their mean
    e = math.exp
    assert stats["ppo/off_policy/weight_mean"] == pytest.approx((2 * e(-3) + 1 + e(-0.5) + 1 + e(-2)) / 6, abs=1e-6)


def test_drift_warnings_name_each_figure_past_its_threshold():
    cfg = load("experiment=ppo-math", "ppo.warn_logprob_gap_mean=0.05", "ppo.warn_logprob_gap_max=1.0",
               "ppo.warn_version_span=2")
    metrics = {"consistency/logprob_gap_mean": 0.2, "consistency/logprob_gap_p99": 0.9,
               "consistency/logprob_gap_max": 0.5, "consistency/version_span": 3.0}
    lines = drift_warnings(metrics, cfg)
    assert len(lines) == 2
    assert lines[0].startswith("consistency/logprob_gap_mean = 0.2 exceeds ppo.warn_logprob_gap_mean = 0.05")
    assert lines[1].startswith("consistency/version_span = 3 exceeds ppo.warn_version_span = 2")
    assert drift_warnings({"consistency/logprob_gap_mean": 0.01}, cfg) == []
    assert drift_warnings({}, cfg) == []  # a step that trained nothing


def test_consistency_p99_is_the_nearest_rank_percentile():
    from realcore.mfc.consistency_stats import consistency_stats

    gaps = [torch.arange(1, 101, dtype=torch.float32) / 100, torch.tensor([5.0])]  # 101 values: 0.01 .. 1.0, 5
    out = consistency_stats(gaps, {}, model=None)
    # nearest rank: the ceil(0.99 x 101) = 100th smallest = 1.0; max 5; mean (50.5 + 5) / 101
    assert out["consistency/logprob_gap_p99"] == pytest.approx(1.0)
    assert out["consistency/logprob_gap_max"] == 5.0
    assert out["consistency/logprob_gap_mean"] == pytest.approx(55.5 / 101)
    assert consistency_stats([], {}, model=None) == {}
