"""GAE and the critic's loss against the papers' formulas, written out here on small hand-built
tensors (never by calling the code under test): Schulman et al. 2016 eq. 16 for GAE, InstructGPT's
per-token KL reward, PPO2's clipped value loss. The critic MFCs run on a fake engine that stands
in for an engine's value head only (values() and train_batch's HeadOutput.values)."""

from types import SimpleNamespace

import pytest
import torch

from realcore.api.algorithms import AdvantageInputs, advantage
from realcore.api.config import MFCConfig
from realcore.api.data import SequenceSample
from realcore.api.engine import HeadOutput
from realcore.api.registry import lookup, mfc_spec
from realcore.mfc.critic import CriticTrain, explained_variance, value_loss
from realcore.mfc.gae import gae, kl_penalty_rewards, kl_token_rewards, outcome_token_rewards, whiten


def eq16(rewards, values, mask, gamma, lam):
    """Eq. 16 literally: delta_k over the response tokens, A_k = sum_l (gamma lam)^l delta_{k+l};
    V after the last response token is 0; returns A + V; 0 off the mask."""
    L = len(mask)
    pos = [t for t in range(L) if mask[t]]
    n = len(pos)
    delta = [rewards[pos[k]] + gamma * (values[pos[k + 1]] if k + 1 < n else 0.0) - values[pos[k]] for k in range(n)]
    adv, ret = [0.0] * L, [0.0] * L
    for k in range(n):
        adv[pos[k]] = sum((gamma * lam) ** l * delta[k + l] for l in range(n - k))
        ret[pos[k]] = adv[pos[k]] + values[pos[k]]
    return adv, ret


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.allclose(x.double(), torch.as_tensor(y, dtype=torch.float64), atol=tol), (x, y)


# Two prompt tokens, then four response tokens; a second sequence of 3 + 2.
MASKS = [[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
REWARDS = [[0.0, 0.0, 0.1, -0.2, 0.3, 1.0], [0.0, 0.0, 0.0, 0.5, -1.0]]
VALUES = [[0.0, 0.7, 0.2, 0.4, -0.3, 0.6], [0.0, 0.1, 0.2, 0.9, 0.25]]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0), (1.0, 0.5), (0.0, 1.0)])
def test_gae_is_eq16(gamma, lam):
    adv, ret = gae([t(r) for r in REWARDS], [t(v) for v in VALUES], [t(m, torch.int64) for m in MASKS], gamma, lam)
    want = [eq16(r, v, m, gamma, lam) for r, v, m in zip(REWARDS, VALUES, MASKS)]
    close(adv, [w[0] for w in want])
    close(ret, [w[1] for w in want])


def test_gae_random_batch_of_uneven_lengths():
    g = torch.Generator().manual_seed(0)
    masks, rewards, values = [], [], []
    for L, p in [(9, 3), (4, 1), (12, 7), (2, 1), (7, 6)]:
        masks.append([0] * p + [1] * (L - p))
        rewards.append(torch.randn(L, generator=g).tolist())
        values.append(torch.randn(L, generator=g).tolist())
    adv, ret = gae([t(r) for r in rewards], [t(v) for v in values], [t(m) for m in masks], 0.97, 0.9)
    want = [eq16(r, v, m, 0.97, 0.9) for r, v, m in zip(rewards, values, masks)]
    close(adv, [w[0] for w in want])
    close(ret, [w[1] for w in want])


def test_gamma_1_lam_1_is_return_to_go_minus_value():
    r, v, m = REWARDS[0], VALUES[0], MASKS[0]
    adv, ret = gae([t(r)], [t(v)], [t(m)], 1.0, 1.0)
    # Response tokens 2..5: return-to-go sum_{s >= t} r_s, minus V_t.
    rtg = [0, 0, 0.1 - 0.2 + 0.3 + 1.0, -0.2 + 0.3 + 1.0, 0.3 + 1.0, 1.0]
    close(adv, [[rtg[i] - v[i] if m[i] else 0.0 for i in range(6)]])
    close(ret, [[rtg[i] if m[i] else 0.0 for i in range(6)]])


def test_lam_0_is_the_td_error():
    r, v, m = REWARDS[0], VALUES[0], MASKS[0]
    gamma = 0.8
    adv, _ = gae([t(r)], [t(v)], [t(m)], gamma, 0.0)
    td = [0, 0, r[2] + gamma * v[3] - v[2], r[3] + gamma * v[4] - v[3], r[4] + gamma * v[5] - v[4], r[5] - v[5]]
    close(adv, [td])


def test_prompt_tokens_get_zero_whatever_their_rewards_and_values():
    r = [5.0, -3.0, 0.5, 1.0]
    v = [9.0, -7.0, 0.2, 0.4]
    adv, ret = gae([t(r)], [t(v)], [t([0, 0, 1, 1])], 0.9, 0.9)
    assert adv[0][:2].tolist() == [0.0, 0.0] and ret[0][:2].tolist() == [0.0, 0.0]
    close(adv, [eq16(r, v, [0, 0, 1, 1], 0.9, 0.9)[0]])


def test_one_response_token_and_none():
    adv, ret = gae([t([0.0, 0.0, 2.0]), t([0.0, 0.0])], [t([0.0, 0.3, 0.5]), t([0.0, 0.3])],
                   [t([0, 0, 1]), t([0, 0])], 0.9, 0.95)
    close(adv, [[0, 0, 2.0 - 0.5], [0, 0]])  # the episode ends after it: A = r - V
    close(ret, [[0, 0, 2.0], [0, 0]])


def test_environment_tokens_between_turns_are_part_of_the_transition():
    # Multi-turn: response, 2 tool tokens (off the mask), response. The step after token 2 is token 5.
    m = [0, 1, 1, 0, 0, 1, 1]
    r = [0.0, 0.1, 0.2, 9.0, 9.0, 0.3, 1.0]  # rewards on off-mask tokens are not the policy's: ignored
    v = [0.0, 0.5, 0.6, 7.0, 7.0, 0.7, 0.8]
    adv, ret = gae([t(r)], [t(v)], [t(m)], 0.9, 0.8)
    close(adv, [eq16(r, v, m, 0.9, 0.8)[0]])
    g = 0.9
    assert adv[0][2].item() == pytest.approx((0.2 + g * 0.7 - 0.6) + g * 0.8 * (0.3 + g * 0.8 - 0.7)
                                             + (g * 0.8) ** 2 * (1.0 - 0.8), abs=1e-5)


def test_gae_rejects_bad_input():
    with pytest.raises(ValueError, match="gamma and lam"):
        gae([t([0.0])], [t([0.0])], [t([1])], 1.5, 1.0)
    with pytest.raises(ValueError, match="values\\[0\\]"):
        gae([t([0.0, 1.0])], [t([0.0])], [t([0, 1])], 1.0, 1.0)


def test_kl_token_rewards_by_hand():
    mask = [t([0, 0, 1, 1, 1]), t([0, 1, 1])]
    behav = [t([0.0, -1.0, -0.5, -2.0, -0.1]), t([0.0, -0.3, -0.4])]
    ref = [t([0.0, -3.0, -0.7, -1.0, -0.1]), t([0.0, -0.3, -0.9])]
    rewards = t([1.0, -1.0])
    out = kl_token_rewards(rewards, behav, ref, mask, 0.1)
    # -0.1 (behav - ref) on the response tokens; the outcome on the last one.
    close(out, [[0, 0, -0.1 * 0.2, -0.1 * -1.0, 1.0 + 0.0], [0, 0, -1.0 - 0.1 * 0.5]])
    close(kl_penalty_rewards(behav, ref, mask, 0.1), [[0, 0, -0.02, 0.1, 0.0], [0, 0, -0.05]])
    close(outcome_token_rewards(rewards, mask), [[0, 0, 0, 0, 1.0], [0, 0, -1.0]])
    close(kl_token_rewards(rewards, None, None, mask, 0.0), [[0, 0, 0, 0, 1.0], [0, 0, -1.0]])
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_token_rewards(rewards, behav, None, mask, 0.1)


def test_registered_gae_adds_the_outcome_to_the_token_rewards():
    masks = [t(m) for m in MASKS]
    values = [t(v) for v in VALUES]
    token_rewards = [t([0.0, 0.0, 0.1, -0.2, 0.3, 0.0]), t([0.0, 0.0, 0.0, 0.5, 0.0])]
    outcome = t([1.0, -1.0])  # on the last response token: REWARDS exactly
    args = SimpleNamespace(gamma=0.9, lam=0.95, gae_whiten=False)
    out = advantage("gae")(AdvantageInputs(outcome, [1, 1], masks, token_rewards, values, args))
    want = [eq16(r, v, m, 0.9, 0.95) for r, v, m in zip(REWARDS, VALUES, MASKS)]
    close(out.advantages, [w[0] for w in want])
    close(out.returns, [w[1] for w in want])

    args.gae_whiten = True  # whitened over the batch's 6 response tokens; the returns are not
    white = advantage("gae")(AdvantageInputs(outcome, [1, 1], masks, token_rewards, values, args))
    on = [w[0][i] for w, m in zip(want, MASKS) for i in range(len(m)) if m[i]]
    mean = sum(on) / len(on)
    std = (sum((a - mean) ** 2 for a in on) / len(on)) ** 0.5
    close(white.advantages, [[(w[0][i] - mean) / std if m[i] else 0.0 for i in range(len(m))] for w, m in zip(want, MASKS)])
    close(white.returns, [w[1] for w in want])

    with pytest.raises(ValueError, match="values"):
        advantage("gae")(AdvantageInputs(outcome, [1, 1], masks, None, None, args))
    with pytest.raises(ValueError, match="args.lam"):
        advantage("gae")(AdvantageInputs(outcome, [1, 1], masks, None, values, SimpleNamespace(gamma=1.0)))


def test_whiten_of_one_token_is_zero():
    assert whiten([t([0.0, 3.0])], [t([0, 1])])[0].tolist() == [0.0, 0.0]


# The clipped value loss, by hand: V_old, R, V_new on four response tokens and one prompt token.
V_OLD = [0.0, 0.5, 0.5, 0.0, 1.0]
RET = [0.0, 1.0, 0.0, 0.3, 1.0]
V_NEW = [9.0, 0.9, 0.9, 0.1, 1.5]
MASK = [0, 1, 1, 1, 1]


def hand_value_loss(eps):
    per = []
    for v, o, r, m in zip(V_NEW, V_OLD, RET, MASK):
        if not m:
            continue
        l1 = (v - r) ** 2
        if eps is None:
            per.append((l1, False))
            continue
        vc = min(max(v, o - eps), o + eps)
        l2 = (vc - r) ** 2
        per.append((max(l1, l2), l2 > l1))
    return 0.5 * sum(p for p, _ in per) / len(per), sum(c for _, c in per) / len(per)


@pytest.mark.parametrize("eps", [None, 0.2, 10.0])
def test_value_loss_is_ppo2s(eps):
    loss, stats = value_loss(t(V_NEW), t(V_OLD), t(RET), t(MASK), eps)
    want, clipfrac = hand_value_loss(eps)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(clipfrac)
    if eps == 0.2:  # token 1: V moved 0.4 towards R, past it; clipped at 0.7 its error is larger, and it counts
        assert clipfrac == 0.25 and want > hand_value_loss(None)[0]


def test_value_loss_gradient_is_zero_where_clipped():
    v = t(V_NEW).requires_grad_()
    value_loss(v, t(V_OLD), t(RET), t(MASK), 0.2)[0].backward()
    # token 1 is clipped (V - V_old = 0.4 > 0.2 and the clipped loss is larger): no gradient; prompt: none
    assert v.grad[0].item() == 0.0 and v.grad[1].item() == 0.0
    assert v.grad[2].item() == pytest.approx((0.9 - 0.0) / 4)  # 0.5 * 2 (V - R) / n_tokens: the unclipped term


class FakeValueEngine:
    """Stands in for an engine's value head only: values() returns given values, train_batch packs
    the data and hands loss_fn a HeadOutput whose values are given too, as a role with head: value would."""

    def __init__(self, values, new_values):
        self._values, self._new = values, new_values
        self.calls = []

    def values(self, input_ids, *, max_tokens_per_mb=None):
        assert [len(x) for x in input_ids] == [len(v) for v in self._values]
        return [v.clone() for v in self._values]

    def train_batch(self, data, loss_fn, loss_weight_fn, *, n_minibatches=1, temperature=1.0,
                    max_tokens_per_mb=None, group_sizes=None):
        lens = [len(x) for x in data["input_ids"]]
        assert all(len(v) == n for k, seqs in data.items() for v, n in zip(seqs, lens)), "every key per token"
        packed = {k: torch.cat(v) for k, v in data.items()}
        cu = torch.tensor([0] + lens).cumsum(0)
        vals = torch.cat(self._new).requires_grad_()
        loss, stats = loss_fn(HeadOutput(cu, values=vals), packed)
        loss.backward()
        self.calls.append((n_minibatches, packed, loss.item()))
        return {**{k: float(v) for k, v in stats.items()}, "grad_norm": float(vals.grad.norm()), "lr": 0.1}


def batch_of(groups):
    return SequenceSample(list(range(len(groups))), groups)


def test_critic_inf_writes_the_value_heads_values():
    cfg = SimpleNamespace()
    m = MFCConfig(name="critic_inf", type="critic_inf", model="critic", inputs=["input_ids"], outputs=["values"])
    vals = [t([0.0, 0.1, 0.2]), t([0.0, 0.3]), t([0.0, 0.5, 0.6, 0.7])]
    batch = batch_of([{"input_ids": [torch.arange(3), torch.arange(2)]}, {"input_ids": [torch.arange(4)]}])
    out = lookup("mfc", "critic_inf")(cfg, m).run(FakeValueEngine(vals, None), batch)
    assert out.ids == [0, 1] and [len(s["values"]) for s in out.samples] == [2, 1]
    close(out.flat("values"), [v.tolist() for v in vals])
    spec = mfc_spec("critic_inf")
    assert (spec.head, spec.trains, spec.micro_batches, spec.needs_model) == ("value", False, True, True)


@pytest.mark.parametrize("eps", [None, 0.2])
def test_critic_train_regresses_on_the_gae_returns(eps):
    # One sequence [prompt, prompt, r, r, r]: with kl_in_reward, rewards -0.1 (behav - ref) + outcome.
    mask = [0, 0, 1, 1, 1]
    old = [0.0, 0.2, 0.3, 0.5, 0.4]
    new = [0.0, 3.0, 0.9, 0.1, 0.45]
    behav, ref = [0.0, -1.0, -0.5, -2.0, -0.1], [0.0, -1.0, -0.7, -1.0, -0.1]
    outcome, kl, gamma, lam = 1.0, 0.1, 0.9, 0.8
    r = [0.0, 0.0, -kl * 0.2, -kl * -1.0, outcome]
    _, R = eq16(r, old, mask, gamma, lam)
    args = {"gamma": gamma, "lam": lam, "kl_in_reward": kl, "value_eps_clip": eps, "n_minibatches": 2, "epochs": 3}
    m = MFCConfig(name="critic_train", type="critic_train", model="critic", args=args,
                  inputs=["input_ids", "loss_mask", "rewards", "values", "behav_logprobs", "ref_logprobs"])
    batch = batch_of([{"input_ids": [torch.arange(5)], "loss_mask": [t(mask, torch.bool)], "rewards": [t([outcome])],
                       "values": [t(old)], "behav_logprobs": [t(behav)], "ref_logprobs": [t(ref)]}])
    engine = FakeValueEngine(None, [t(new)])
    stats = lookup("mfc", "critic_train")(SimpleNamespace(), m).run(engine, batch)

    assert len(engine.calls) == 3 and all(c[0] == 2 for c in engine.calls)  # epochs x train_batch(n_minibatches)
    close([engine.calls[0][1]["returns"]], [R])
    per, clipped = [], []
    for v, o, ret, on in zip(new, old, R, mask):
        if on:
            vc = v if eps is None else min(max(v, o - eps), o + eps)
            per.append(max((v - ret) ** 2, (vc - ret) ** 2))
            clipped.append((vc - ret) ** 2 > (v - ret) ** 2)
    assert stats["critic/value_loss"] == pytest.approx(0.5 * sum(per) / 3, abs=1e-6)
    assert stats["critic/clipfrac"] == pytest.approx(sum(clipped) / 3)
    assert (sum(clipped) > 0) == (eps is not None)  # tokens 2 and 3 moved more than 0.2 from their old values
    resid = [ret - o for ret, o, on in zip(R, old, mask) if on]
    Rs = [ret for ret, on in zip(R, mask) if on]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert stats["critic/explained_variance"] == pytest.approx(1 - var(resid) / var(Rs), abs=1e-5)
    assert {"critic/grad_norm", "critic/lr"} <= set(stats) and "loss" not in stats and "lr" not in stats


def test_critic_train_returns_match_the_updates_gae():
    # The actor's gae (token_rewards = the KL penalty, as the update hands it) and the critic's
    # targets are the same returns: one anchor of gamma, lam, kl_in_reward sets both.
    masks = [t(m) for m in MASKS]
    values = [t(v) for v in VALUES]
    g = torch.Generator().manual_seed(1)
    behav = [torch.randn(len(m), generator=g) for m in MASKS]
    ref = [torch.randn(len(m), generator=g) for m in MASKS]
    outcome = t([0.5, -0.25])
    args = SimpleNamespace(gamma=0.95, lam=0.9, gae_whiten=True)
    upd = advantage("gae")(AdvantageInputs(outcome, [2], masks, kl_penalty_rewards(behav, ref, masks, 0.05), values, args))
    _, R = gae(kl_token_rewards(outcome, behav, ref, masks, 0.05), values, masks, 0.95, 0.9)
    close(upd.returns, [x.tolist() for x in R])


def test_explained_variance_bounds():
    R = [t([0.0, 1.0, 2.0, 3.0])]
    m = [t([1, 1, 1, 1])]
    assert explained_variance(R, R, m) == pytest.approx(1.0)
    assert explained_variance([t([1.5] * 4)], R, m) == pytest.approx(0.0)
    assert explained_variance([t([0.0] * 4)], [t([1.0] * 4)], m) == 0.0  # returns that do not vary


def test_critic_train_spec_and_config_checks():
    spec = mfc_spec("critic_train")
    assert (spec.head, spec.trains, spec.micro_batches) == ("value", True, True)
    m = MFCConfig(name="c", type="critic_train", model="critic", args={"n_minibatches": 2, "epochs": 3},
                  inputs=["input_ids", "loss_mask", "rewards", "values"])
    assert spec.steps_per_call(None, m) == 6
    CriticTrain.check_config(None, m)
    m.args = {"kl_in_reward": 0.1}
    with pytest.raises(ValueError, match=r"\['behav_logprobs', 'ref_logprobs'\] \(args.kl_in_reward > 0\)"):
        CriticTrain.check_config(None, m)
    m.inputs = ["input_ids", "loss_mask", "rewards"]
    m.args = {}
    with pytest.raises(ValueError, match=r"critic_train reads \['values'\]"):
        CriticTrain.check_config(None, m)
    with pytest.raises(ValueError, match="value_eps_clip"):
        CriticTrain.Args(value_eps_clip=0)


def test_the_master_registers_them_without_torch():
    import subprocess
    import sys

    code = ("import sys, realcore.mfc.gae, realcore.mfc.critic; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
