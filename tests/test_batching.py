"""Micro- and minibatch splitting that keeps groups together, and the packed rows' boundaries."""

import pytest
import torch

from realcore.backends.batching import cu_seqlens, groups_within, split_by_budget, split_minibatches


def test_groups_stay_in_one_micro_batch():
    lens = [3, 4, 10, 2, 2, 5]
    assert split_by_budget(lens, 7) == [[0, 1], [2], [3, 4], [5]]
    # Groups (0, 1), (2, 3), (4, 5): a group is never cut, one over the budget gets its own.
    assert split_by_budget(lens, 7, [2, 2, 2]) == [[0, 1], [2, 3], [4, 5]]
    assert split_by_budget(lens, 20, [2, 2, 2]) == [[0, 1, 2, 3], [4, 5]]
    assert split_by_budget([], 7, []) == []
    with pytest.raises(ValueError, match="do not cover"):
        split_by_budget(lens, 7, [2, 2])


def test_minibatches_split_by_whole_groups():
    assert [list(r) for r in split_minibatches(6, 2)] == [[0, 1, 2], [3, 4, 5]]
    assert [list(r) for r in split_minibatches(6, 2, [2, 2, 2])] == [[0, 1, 2, 3], [4, 5]]
    chunks = split_minibatches(7, 3, [3, 1, 2, 1])
    assert [list(r) for r in chunks] == [[0, 1, 2, 3], [4, 5], [6]]
    assert [groups_within(c, [3, 1, 2, 1]) for c in chunks] == [[3, 1], [2], [1]]
    assert [list(r) for r in split_minibatches(2, 3, [2])] == [[0, 1], [], []]


def test_cu_seqlens():
    assert cu_seqlens([3, 1, 4]).tolist() == [0, 3, 4, 8] and cu_seqlens([3]).dtype == torch.int32
