"""Admission under the staleness bound (AReaL's rule) and the decoupled-PPO wiring of ppo_update."""

import pytest

from realcore.system.staleness import StalenessController, admit, is_stale


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("clients", [1, 2, 8])
def test_admitted_rollouts_at_version_0(eta, clients):
    # Every client keeps asking; nothing finishes yet. AReaL's form of the bound:
    # admitted = min(batch_size * clients, (1 + eta) * batch_size).
    batch_size = 4
    ctl = StalenessController(batch_size, eta, max_concurrent_rollouts=batch_size * clients)
    admitted = sum(ctl.try_allocate() for _ in range(1000))
    assert admitted == min(batch_size * clients, (1 + eta) * batch_size)


def test_versions_release_capacity_and_filtered_rollouts_do_not_count():
    ctl = StalenessController(batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=100)
    assert [ctl.try_allocate() for _ in range(3)] == [True, True, False]
    ctl.finish(accepted=True)
    ctl.finish(accepted=False)  # filtered: frees its slot, counts nothing
    assert (ctl.trained, ctl.running) == (1, 0)
    assert [ctl.try_allocate() for _ in range(2)] == [True, False]  # batch 0 needs one more sample
    ctl.finish(accepted=True)
    assert not ctl.try_allocate()  # batch 0 is full; batch 1 must wait for version 1
    ctl.version = 1
    assert [ctl.try_allocate() for _ in range(3)] == [True, True, False]


def test_concurrency_cap():
    assert not admit(trained=0, running=3, batch_size=100, current_version=0, max_head_offpolicyness=9, max_concurrent_rollouts=3)
    assert admit(trained=0, running=2, batch_size=100, current_version=0, max_head_offpolicyness=9, max_concurrent_rollouts=3)


def test_staleness_never_exceeds_eta_in_a_simulation():
    """Rollouts finish in random order; batches are taken in arrival order, too-stale samples
    dropped (and forgotten by the controller). The trained version minus each trained sample's
    start version never exceeds eta, drops stay rare, and training never starves."""
    import random

    rng = random.Random(0)
    for eta in (0, 1, 3):
        B = 4
        ctl = StalenessController(B, eta, max_concurrent_rollouts=12)
        running, arrived, worst, dropped, steps = [], [], 0, 0, 0
        for _ in range(2000):
            while ctl.try_allocate():
                running.append(ctl.version)  # the version it starts generating with
            rng.shuffle(running)
            arrived.append(running.pop())
            ctl.finish(accepted=True)
            stale = [v for v in arrived if is_stale(v, current_version=ctl.version, max_head_offpolicyness=eta)]
            arrived = [v for v in arrived if not is_stale(v, current_version=ctl.version, max_head_offpolicyness=eta)]
            ctl.drop(len(stale))
            dropped += len(stale)
            if len(arrived) >= B:  # the trainer takes a batch and publishes a new version
                batch, arrived = arrived[:B], arrived[B:]
                worst = max(worst, max(ctl.version - v for v in batch))
                ctl.version += 1
                steps += 1
        assert worst <= eta, (eta, worst)
        # Random completion order is a harsh tail (a rollout can be overtaken forever); still most
        # samples train and the trainer never starves.
        assert steps > 300 and dropped < 0.5 * steps * B, (eta, steps, dropped)


def test_dynamic_filtering_and_trajectory_layout():
    from realcore.backends.gen_client import Trajectory
    from realcore.system.rollout_worker import keep_group, trajectory_sample
    from realcore.system.stream import decode_group, encode_group

    assert keep_group([0.0, 1.0], True) and keep_group([1.0, 1.0], False)
    assert not keep_group([1.0, 1.0, 1.0], True) and not keep_group([0.0, 0.0], True)
    t = Trajectory([7, 8], [-0.5, -0.25], [0, 1], 0, 1, "stop", 2)
    sample = trajectory_sample([1, 2, 3], [(t, 1.0)])
    assert sample["input_ids"][0].tolist() == [1, 2, 3, 7, 8]
    assert sample["loss_mask"][0].tolist() == [0, 0, 0, 1, 1]
    assert sample["behav_logprobs"][0].tolist() == [0, 0, 0, -0.5, -0.25]
    assert (int(sample["version_start"][0]), int(sample["version_end"][0]), float(sample["rewards"][0])) == (0, 1, 1.0)
    back = decode_group(*encode_group(sample))
    assert all(torch_equal(back[k], sample[k]) for k in sample)


def torch_equal(a, b):
    return len(a) == len(b) and all((x == y).all() for x, y in zip(a, b))
