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


def test_reduce_weighted_reads_sums_left_on_the_device_as_it_reads_floats():
    """The engines leave each statistic's weighted sum on the device (a scalar tensor) and
    reduce_weighted reads them in one copy: the same numbers as sums of Python floats."""
    from realcore.backends.batching import reduce_weighted, stat_on

    stats = [({"loss": torch.tensor(1.7, dtype=torch.float32), "kl": 0.25}, 3.0),
             ({"loss": torch.tensor(-0.3, dtype=torch.float32)}, 5.0)]
    floats, tensors, weights = {}, {}, {}
    for s, w in stats:
        for k, v in s.items():
            floats[k] = floats.get(k, 0.0) + float(v) * w
            tensors[k] = tensors.get(k, 0.0) + stat_on(v, torch.device("cpu")) * w
            weights[k] = weights.get(k, 0.0) + w
    got = reduce_weighted(tensors, weights, None, 1)
    assert got == reduce_weighted(floats, weights, None, 1)
    assert got == {"kl": 0.25, "loss": (float(torch.tensor(1.7)) * 3 - float(torch.tensor(0.3)) * 5) / 8}
    assert reduce_weighted({}, {}, None, 1) == {}


def test_collectives_use_the_device_of_their_groups_backend(monkeypatch):
    """Mocks an NCCL group and a GPU (a CPU has neither): an NCCL group's tensors go on the current
    GPU, a gloo group's on the CPU; engines compute on the current GPU when there is one."""
    import torch.distributed as dist

    from realcore.backends.device import compute_device, group_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert group_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert group_device() == torch.device("cpu")
    assert compute_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compute_device() == torch.device("cuda", 3)
