"""Admission under the staleness bound (AReaL's rule) and the decoupled-PPO wiring of ppo_update."""

import pytest

from realcore.transport.protocol import ManagerState
from realcore.api.versions import doomed, drop_bound, is_stale, update_mode
from realcore.rollout.admission import Admission, admit


class Ctl:
    """Admission driven as one rollout worker would: seqs in, FINISH out (the order given)."""

    def __init__(self, batch_size, eta, max_concurrent_rollouts, journal=None):
        self.a = Admission(batch_size, eta, max_concurrent_rollouts, journal)
        if not self.a.restored:
            self.a.restore(ManagerState(), None)
        self.seqs = []

    def try_allocate(self, worker=0):
        got = self.a.allocate(worker)
        if got is not None:
            self.seqs.append(got)
        return got is not None

    def finish(self, accepted, worker=0):
        seq, grant = self.seqs.pop(0)
        self.a.finish(worker, seq, grant, accepted, {})
        return grant

    @property
    def version(self):
        return self.a.state.version

    @version.setter
    def version(self, v):
        self.a.set_version(v, None)


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("clients", [1, 2, 8])
def test_admitted_rollouts_at_version_0(eta, clients):
    # Every client keeps asking; nothing finishes yet. AReaL's form of the bound:
    # admitted = min(batch_size * clients, (1 + eta) * batch_size).
    batch_size = 4
    ctl = Ctl(batch_size, eta, max_concurrent_rollouts=batch_size * clients)
    admitted = sum(ctl.try_allocate() for _ in range(1000))
    assert admitted == min(batch_size * clients, (1 + eta) * batch_size)


def test_versions_release_capacity_and_filtered_rollouts_do_not_count():
    ctl = Ctl(batch_size=2, eta=0, max_concurrent_rollouts=100)
    assert [ctl.try_allocate() for _ in range(3)] == [True, True, False]
    ctl.finish(accepted=True)
    ctl.finish(accepted=False)  # filtered: frees its slot, counts nothing
    assert (ctl.a.trained, ctl.a.running) == (1, 0)
    assert [ctl.try_allocate() for _ in range(2)] == [True, False]  # batch 0 needs one more sample
    ctl.finish(accepted=True)
    assert not ctl.try_allocate()  # batch 0 is full; batch 1 must wait for version 1
    ctl.version = 1
    assert [ctl.try_allocate() for _ in range(3)] == [True, True, False]


def test_nothing_is_admitted_before_the_master_restores():
    a = Admission(4, 1, 8)
    assert a.allocate(0) is None
    a.restore(ManagerState(), None)
    assert a.allocate(0) == (0, 0)


def test_a_dead_workers_rollouts_run_again_and_count_once():
    """Worker 0 dies with seqs 1 and 2 in flight; its successor registers with nothing running:
    they are handed out again first, and the running count never held them twice."""
    ctl = Ctl(batch_size=100, eta=0, max_concurrent_rollouts=100)
    for _ in range(3):
        ctl.try_allocate()
    ctl.a.finish(0, 0, 0, True, {})
    assert (ctl.a.running, ctl.a.trained) == (2, 1)
    ctl.a.register(0, [])  # the restarted worker
    assert ctl.a.running == 0 and ctl.a.state.redo[0] == [1, 2]
    assert [ctl.a.allocate(0) for _ in range(3)] == [(1, 3), (2, 4), (3, 5)]  # new grants
    assert ctl.a.running == 3
    ctl.a.finish(0, 1, 3, True, {})
    ctl.a.finish(0, 1, 3, True, {})  # a FINISH sent twice counts once
    assert (ctl.a.running, ctl.a.trained) == (2, 2)


def test_only_counted_copies_uncount():
    """Grant 1's group reached a stream, but its worker died before FINISH: the prompt runs again
    as grant 3, which is counted. Dropping the uncounted copy (stale) changes nothing; dropping or
    training the counted one resolves it; resolving twice is harmless."""
    ctl = Ctl(batch_size=100, eta=0, max_concurrent_rollouts=100)
    for _ in range(3):
        ctl.try_allocate()
    ctl.a.register(0, [])  # seqs 0-2 (grants 0-2) run again
    assert [ctl.a.allocate(0) for _ in range(3)] == [(0, 3), (1, 4), (2, 5)]
    for seq, grant in ((0, 3), (1, 4), (2, 5)):
        ctl.a.finish(0, seq, grant, True, {})
    assert ctl.a.trained == 3 and sorted(ctl.a.state.unresolved) == [3, 4, 5]
    ctl.a.resolve(trained=[], dropped=[1])  # the old copy of seq 1: never counted
    assert ctl.a.trained == 3
    ctl.a.resolve(trained=[3], dropped=[4])
    ctl.a.resolve(trained=[3], dropped=[4])
    assert ctl.a.trained == 2 and ctl.a.state.unresolved == [5] and ctl.a.state.dropped == 1


def test_a_group_taken_before_its_finish_is_settled_by_it():
    """The stream acknowledges a group before its worker says FINISH: the master may take it
    first. The FINISH then settles it (counted and, if dropped, uncounted) instead of leaving it
    "awaiting training" forever."""
    ctl = Ctl(batch_size=100, eta=0, max_concurrent_rollouts=100)
    for _ in range(2):
        ctl.try_allocate()
    ctl.a.resolve(trained=[0], dropped=[1])
    ctl.finish(accepted=True)
    ctl.finish(accepted=True)
    s = ctl.a.state
    assert (s.accepted, s.dropped, s.unresolved, s.taken_early, ctl.a.trained) == (2, 1, [], {}, 1)


def test_registration_after_a_manager_restart_keeps_live_rollouts():
    """A rollout worker re-registers with what it still runs: those stay running; a grant the
    dead manager recorded but the worker never received runs again."""
    ctl = Ctl(batch_size=100, eta=0, max_concurrent_rollouts=100)
    for _ in range(3):
        ctl.try_allocate()
    ctl.a.register(0, [0, 2])  # seq 1's grant was lost with the old manager
    assert ctl.a.state.running[0] == {0: 0, 2: 2} and ctl.a.state.redo[0] == [1]
    assert ctl.a.allocate(0) == (1, 3)


def test_restore_moves_running_rollouts_to_redo_once():
    state = ManagerState(version=3, accepted=10, dropped=1, next_grant=20, cursor={0: 7, 1: 5}, running={0: {5: 18, 6: 19}, 1: {4: 17}},
                         redo={1: [2]}, counters={"reward/errors": 2})
    a = Admission(4, 2, 16)
    a.restore(state, "/w/v3")
    assert a.running == 0 and a.state.redo == {0: [5, 6], 1: [2, 4]} and a.trained == 9
    a.restore(ManagerState(), None)  # a retried RESTORE: the first holds
    assert a.state.version == 3 and a.weights_path == "/w/v3"
    assert a.allocate(1) == (2, 20) and a.allocate(1) == (4, 21) and a.allocate(1) == (5, 22)


def test_journal_replay_rebuilds_the_same_state(tmp_path):
    """Every change is journaled before it takes effect; a manager started on the journal (after
    a kill at any point) has exactly the state the dead one had, also across a compaction."""
    import random

    rng = random.Random(0)
    path = str(tmp_path / "journal.jsonl")
    live = Ctl(batch_size=4, eta=1, max_concurrent_rollouts=6, journal=path)
    for i in range(400):
        op = rng.random()
        if op < 0.5:
            live.try_allocate(worker=rng.randrange(2))
        elif op < 0.8 and any(live.a.state.running.values()):
            w = rng.choice([w for w, v in live.a.state.running.items() if v])
            seq = rng.choice(list(live.a.state.running[w]))
            live.a.finish(w, seq, live.a.state.running[w][seq], rng.random() < 0.8, {"reward/errors": 1})
        elif op < 0.85:
            live.a.register(rng.randrange(2), [])
        elif op < 0.9:  # the master takes a group: often before its FINISH arrives
            g = rng.randrange(live.a.state.next_grant + 1)
            live.a.resolve(trained=[g] if rng.random() < 0.5 else [], dropped=[] if rng.random() < 0.5 else [g])
        else:
            live.a.set_version(live.a.state.version + 1, f"/w/v{live.a.state.version + 1}")
        if i % 37 == 0:
            with open(path, "a") as f:
                f.write('{"op": "alloc", "w"')  # a line torn by a kill is ignored
            replayed = Admission(4, 1, 6, path)
            assert replayed.restored and replayed.state == live.a.state and replayed.weights_path == live.a.weights_path
            replayed.close()
            live.a._journal.write("\n")  # the torn line ends; the live journal goes on


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_a_rollout_is_doomed_exactly_when_its_drop_at_take_is_certain(eta):
    """The trainer takes a group at a version >= any a server showed, and > the version of a reply
    that a weight update aborted. Doomed only when even that lowest version drops it."""
    for first in range(0, 6):
        for seen in range(first, first + eta + 3):
            for aborted in (False, True):
                lowest_take = seen + (1 if aborted else 0)
                assert doomed(first, seen, aborted=aborted, max_head_offpolicyness=eta) == \
                    is_stale(first, current_version=lowest_take, max_head_offpolicyness=eta)
                # never doomed while some version it may be taken at keeps it
                if not is_stale(first, current_version=lowest_take, max_head_offpolicyness=eta):
                    assert not doomed(first, seen, aborted=aborted, max_head_offpolicyness=eta)
    assert not doomed(3, 3 + eta, aborted=False, max_head_offpolicyness=eta)
    assert doomed(3, 3 + eta, aborted=True, max_head_offpolicyness=eta)


def test_concurrency_cap():
    assert not admit(trained=0, running=3, batch_size=100, current_version=0, max_head_offpolicyness=9, max_concurrent_rollouts=3)
    assert admit(trained=0, running=2, batch_size=100, current_version=0, max_head_offpolicyness=9, max_concurrent_rollouts=3)


B_SIM = 4


def simulate(eta, bound, *, B=B_SIM, rounds=2000):
    """Rollouts finish in random order; batches are taken in arrival order, samples past `bound`
    dropped (and forgotten by the controller; None: none). Returns (worst staleness trained,
    dropped, steps)."""
    import random

    rng = random.Random(0)
    ctl = Ctl(B, eta, max_concurrent_rollouts=12)
    running, arrived, worst, dropped, steps = [], [], 0, 0, 0
    for _ in range(rounds):
        while ctl.try_allocate():
            running.append(ctl.version)  # the version it starts generating with
        rng.shuffle(running)
        start = running.pop()
        arrived.append((start, ctl.finish(accepted=True)))
        stale = [g for v, g in arrived if is_stale(v, current_version=ctl.version, max_head_offpolicyness=bound)]
        arrived = [(v, g) for v, g in arrived if not is_stale(v, current_version=ctl.version, max_head_offpolicyness=bound)]
        dropped += len(stale)
        ctl.a.resolve(trained=[], dropped=stale)
        if len(arrived) >= B:  # the trainer takes a batch and publishes a new version
            batch, arrived = arrived[:B], arrived[B:]
            ctl.a.resolve(trained=[g for _, g in batch], dropped=[])
            worst = max(worst, max(ctl.version - v for v, _ in batch))
            ctl.version += 1
            steps += 1
    return worst, dropped, steps


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_staleness_never_exceeds_eta_in_a_simulation(eta):
    """The hard bound (drop_stale): the trained version minus each trained sample's start version
    never exceeds eta, drops stay rare, and training never starves."""
    worst, dropped, steps = simulate(eta, eta)
    assert worst <= eta, (eta, worst)
    # Random completion order is a harsh tail (a rollout can be overtaken forever); still most
    # samples train and the trainer never starves.
    assert steps > 300 and dropped < 0.5 * steps * B_SIM, (eta, steps, dropped)


@pytest.mark.parametrize("eta", [1, 3])
def test_admission_alone_drops_nothing_and_trains_more(eta):
    """drop_stale=false (AReaL's bound): nothing is dropped, every finished rollout trains, so the
    same rollouts make more steps; a rollout overtaken for long is trained staler than eta. (With
    eta 0 nothing runs past its batch: the two are the same.)"""
    hard_worst, hard_dropped, hard_steps = simulate(eta, eta)
    worst, dropped, steps = simulate(eta, None)
    assert dropped == 0 and hard_dropped > 0
    assert steps > hard_steps and worst > eta, (steps, hard_steps, worst)


def test_drop_bound_and_update_modes():
    from types import SimpleNamespace

    def cfg(drop, inflight, eta=2):
        return SimpleNamespace(rollout=SimpleNamespace(max_head_offpolicyness=eta, drop_stale=drop,
                                                       inflight_weight_update=inflight))

    assert drop_bound(cfg(True, False).rollout) == 2 and drop_bound(cfg(False, False).rollout) is None
    assert not is_stale(0, current_version=100, max_head_offpolicyness=None)
    assert not doomed(0, 100, aborted=True, max_head_offpolicyness=None)
    # Interrupted updates are the same either way (the rollouts resume); in flight, the update
    # ends the requests that will be dropped, and with no bound none.
    assert update_mode(cfg(True, False), 7) == update_mode(cfg(False, False), 7) == {"abort_all_requests": True}
    assert update_mode(cfg(True, True), 7) == {"abort_started_before": 5}
    assert update_mode(cfg(False, True), 7) == {}


def test_dynamic_filtering_and_trajectory_layout():
    from realcore.api.workflow import TRAJECTORY_KEYS, Completion, TrajectoryBuilder, check_trajectories
    from realcore.rollout.rollout_worker import keep_group
    from realcore.transport.stream import Group, decode_group, encode_group

    assert keep_group([0.0, 1.0], True) and keep_group([1.0, 1.0], False)
    assert not keep_group([1.0, 1.0, 1.0], True) and not keep_group([0.0, 0.0], True)
    t = TrajectoryBuilder([1, 2, 3])
    t.add_completion(Completion([7, 8], [-0.5, -0.25], [0, 1], "stop", "x"))
    sample = check_trajectories(t.to_tensors(1.0), TRAJECTORY_KEYS)
    assert sample["input_ids"][0].tolist() == [1, 2, 3, 7, 8]
    assert sample["loss_mask"][0].tolist() == [0, 0, 0, 1, 1]
    assert sample["behav_logprobs"][0].tolist() == [0, 0, 0, -0.5, -0.25]
    assert (int(sample["version_start"][0]), int(sample["version_end"][0]), float(sample["rewards"][0])) == (0, 1, 1.0)
    back = decode_group(*encode_group(Group("r0:3", 7, sample)), TRAJECTORY_KEYS)
    assert (back.uid, back.grant) == ("r0:3", 7) and all(torch_equal(back.sample[k], sample[k]) for k in sample)
    with pytest.raises(ValueError):  # a group with other keys than the workflow declared
        decode_group(*encode_group(Group("r0:3", 7, {**sample, "extra": sample["rewards"]})), TRAJECTORY_KEYS)


def torch_equal(a, b):
    return len(a) == len(b) and all((x == y).all() for x, y in zip(a, b))


def test_a_server_caught_up_during_an_update_ends_at_the_newest_version():
    """The manager catches up a server that came back (disk); if the trainer publishes while the
    server loads, it loads again: it must not stay a version behind (the CI flake of
    test_async_run_with_lora_other_paths: a server caught up to v2 while v3 went out)."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from realcore.rollout.gserver_manager import GServerManager, Server

    m = object.__new__(GServerManager)  # only what _catch_up uses: no sockets, no monitor thread
    m.cfg = SimpleNamespace(rollout=SimpleNamespace(weight_update="disk"))
    m.lock = threading.Lock()
    m.admission = Admission(4, 1, 8)
    m.admission.restore(ManagerState(), None)
    m.admission.set_version(2, "/w/v2")
    loads = []

    class Client:
        async def weight_version(self):
            return "0"  # restarted with the initial weights

        async def update_weights_from_disk(self, path, version):
            loads.append((path, version))
            if len(loads) == 1:  # the trainer publishes v3 while the server loads v2
                m.admission.set_version(3, "/w/v3")

    s = Server(0, "http://x", healthy=True)
    asyncio.run(m._catch_up(s, Client()))
    assert loads == [("/w/v2", 2), ("/w/v3", 3)] and s.holds == 3
