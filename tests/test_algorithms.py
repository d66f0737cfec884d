"""Advantage estimators and DAPO's overlong shaping against the papers' formulas, computed here in plain
Python on small hand-built batches (never by calling realcore's own helpers)."""

import math
from types import SimpleNamespace

import pytest
import torch

from realcore.api.algorithms import AdvantageInputs, advantage, advantages_registered
from realcore.mfc import advantages as adv_mod  # noqa: F401  (registers the estimators)
from realcore.mfc.advantages import overlong_penalty

torch.set_num_threads(1)

# three sequences in groups [2 | 1]; prompt tokens first (mask 0), response after
MASKS = [torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 1, 1, 1]), torch.tensor([0, 1])]


def inputs(rewards, group_sizes, masks=MASKS, token_rewards=None, **args):
    return AdvantageInputs(torch.tensor(rewards, dtype=torch.float32), group_sizes, masks, token_rewards,
                           None, SimpleNamespace(**args) if args else None)


def on_mask(values_per_seq, masks=MASKS):
    """A per-sequence number on that sequence's mask tokens, 0 elsewhere (the expected broadcast)."""
    return [[v if int(m) else 0.0 for m in mask] for v, mask in zip(values_per_seq, masks)]


def assert_adv(out, expected, tol=1e-5):
    assert len(out.advantages) == len(expected)
    for got, want in zip(out.advantages, expected):
        assert got.shape == (len(want),)
        assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=tol), (got, want)


def pop_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def test_all_named_estimators_are_registered():
    assert {"grpo", "dr-grpo", "rloo", "reinforce++", "reinforce++-baseline"} <= set(advantages_registered())
    with pytest.raises(KeyError, match="unknown advantage 'nope'"):
        advantage("nope")


def test_grpo_group_normalised_and_broadcast_on_the_mask():
    # DeepSeekMath eq. 3: A_i = (r_i - mean(r)) / std(r) per group (population std, + eps)
    r, eps = [1.0, 0.0, 0.5], 1e-6
    g1 = r[:2]
    a1 = [(x - sum(g1) / 2) / (pop_std(g1) + eps) for x in g1]  # [1, -1] (up to eps)
    out = advantage("grpo")(inputs(r, [2, 1], adv_norm="group", adv_eps=eps))
    assert_adv(out, on_mask([a1[0], a1[1], 0.0]))  # a group of one: 0


def test_grpo_batch_norm_and_equal_rewards():
    # norm=batch: group-centred, divided by the batch std of the centred values (current ppo.adv_norm=batch)
    r = [1.0, 0.0, 3.0, 1.0]
    masks = [torch.tensor([1, 1])] * 4
    centred = [0.5, -0.5, 1.0, -1.0]
    s = pop_std(centred)
    out = advantage("grpo")(inputs(r, [2, 2], masks, adv_norm="batch", adv_eps=1e-6))
    assert_adv(out, on_mask([c / (s + 1e-6) for c in centred], masks))
    # equal rewards in every group: exactly 0
    out = advantage("grpo")(inputs([0.7, 0.7, 0.7], [3], [torch.tensor([1])] * 3))
    assert all(float(a.abs().max()) == 0.0 for a in out.advantages)


def test_dr_grpo_is_centred_not_divided():
    # Liu et al. 2025: A_i = r_i - mean(r_group)
    r = [1.0, 0.0, 0.0, 2.0, 5.0]
    masks = [torch.tensor([0, 1])] * 5
    out = advantage("dr-grpo")(inputs(r, [4, 1], masks))
    mean = sum(r[:4]) / 4
    assert_adv(out, on_mask([x - mean for x in r[:4]] + [0.0], masks))


def test_rloo_leave_one_out_baseline():
    # Ahmadian et al. 2024 (RLOO): A_i = r_i - 1/(k-1) sum_{j != i} r_j
    r = [1.0, 0.0, 0.5, 2.0, 4.0]
    masks = [torch.tensor([0, 1, 1])] * 5
    expected = []
    for i in range(3):
        others = [r[j] for j in range(3) if j != i]
        expected.append(r[i] - sum(others) / len(others))
    expected += [0.0]  # the group of one (r=2) has no other sample
    expected += [0.0]  # and so does the last
    out = advantage("rloo")(inputs(r, [3, 1, 1], masks))
    assert_adv(out, on_mask(expected, masks))


def _rtg(rewards, gamma):
    """Return-to-go by its definition: G_t = sum_{k >= t} gamma^(k - t) r_k (over the response tokens)."""
    return [sum(gamma ** (k - t) * rewards[k] for k in range(t, len(rewards))) for t in range(len(rewards))]


def _whiten_flat(values):
    m = sum(values) / len(values)
    s = pop_std(values)
    return [(v - m) / (s + 1e-6) for v in values]


def _on_masks(flat: list[float]) -> list[list[float]]:
    """The response tokens' values of `flat`, laid back on MASKS (0 on the prompt tokens)."""
    expected, i = [], 0
    for m in MASKS:
        row = []
        for on in m:
            row.append(flat[i] if int(on) else 0.0)
            i += int(on)
        expected.append(row)
    return expected


def test_reinforce_pp_token_rewards_return_to_go_and_batch_norm():
    # Hu 2025 (REINFORCE++): r_t = -beta KL_t on every response token, + the outcome on the last one;
    # A_t = sum_{k>=t} gamma^(k-t) r_k, then normalised over all response tokens of the batch.
    gamma = 0.9
    kl = [[0.0, 0.0, -0.1, -0.2], [0.0, 0.05, -0.05, 0.1, 0.0], [0.0, -0.3]]  # already -beta KL, 0 off the mask
    outcome = [1.0, 0.0, 0.5]
    resp_rewards = []
    for k, m, o in zip(kl, MASKS, outcome):
        rr = [x for x, on in zip(k, m) if int(on)]
        rr[-1] += o
        resp_rewards.append(rr)
    returns = [_rtg(rr, gamma) for rr in resp_rewards]
    flat = _whiten_flat([x for g in returns for x in g])
    expected = _on_masks(flat)
    tr = [torch.tensor(k) for k in kl]
    out = advantage("reinforce++")(inputs(outcome, [2, 1], token_rewards=tr, gamma=gamma, adv_eps=1e-6))
    assert_adv(out, expected)


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    # OpenRLHF reinforce_baseline / Hu 2025: r - mean_group, then return-to-go (gamma 1, no KL) and batch norm
    r = [1.0, 0.0, 0.5]
    centred = [0.5, -0.5, 0.0]  # the group of one is centred to 0
    returns = [[c] * int(m.sum()) for c, m in zip(centred, MASKS)]  # gamma 1, reward on the last token only
    flat = _whiten_flat([x for g in returns for x in g])
    expected = _on_masks(flat)
    out = advantage("reinforce++-baseline")(inputs(r, [2, 1], gamma=1.0, adv_eps=1e-6))
    assert_adv(out, expected)


def test_reinforce_pp_equal_rewards_and_no_kl_give_zero():
    out = advantage("reinforce++")(inputs([0.9, 0.9, 0.9], [3], [torch.tensor([0, 1])] * 3))
    assert all(float(a.abs().max()) == 0.0 for a in out.advantages)


def test_all_tokens_masked_gives_zero_advantages_everywhere():
    masks = [torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long)]
    for name in ("grpo", "dr-grpo", "rloo", "reinforce++", "reinforce++-baseline"):
        out = advantage(name)(inputs([1.0, 0.0], [2], masks))
        assert [a.shape for a in out.advantages] == [(3,), (2,)]
        assert all(float(a.abs().max()) == 0.0 for a in out.advantages), name


def test_groups_of_one_give_zero_for_group_baselines():
    masks = [torch.tensor([0, 1])] * 3
    for name in ("grpo", "dr-grpo", "rloo", "reinforce++-baseline"):
        out = advantage(name)(inputs([1.0, 0.0, 3.0], [1, 1, 1], masks))
        assert all(float(a.abs().max()) == 0.0 for a in out.advantages), name


def test_overlong_penalty_dapo_eq13():
    # L_max 10, L_cache 4: |y| <= 6 -> 0; 6 < |y| <= 10 -> (6 - |y|) / 4; |y| > 10 -> -1
    lengths = [3, 6, 7, 9, 10, 11, 40]

    def r_length(y, lmax=10, lcache=4):
        if y <= lmax - lcache:
            return 0.0
        if y <= lmax:
            return ((lmax - lcache) - y) / lcache
        return -1.0

    got = overlong_penalty(torch.tensor(lengths), 10, 4, factor=1.0)
    assert torch.allclose(got, torch.tensor([r_length(y) for y in lengths]))
    assert torch.allclose(overlong_penalty(torch.tensor(lengths), 10, 4, factor=0.5), 0.5 * got)
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(torch.tensor(lengths), 10, 11)
