"""One FETCH or RUN_MFC for a node's workers as one SPLIT (columns.py): the relay cuts it into each
worker's own request and joins their replies. Real ControlServers and a WorkerPool over loopback
(test_relay.Node); the columns' own rules tested directly."""

import time

import pytest
import zmq

from realcore.transport import columns
from realcore.transport.node_relay import NodeRelay
from realcore.transport.pool import Columns, Gathered
from realcore.transport.reply import wait_all
from realcore.transport.protocol import (Cmd, Fetch, Fetched, MFCDone, RemoteError, RunMFC, Split, WorkerLost, parse,
                                      to_body)
from tests.test_relay import Node


def answer_mfc(msg, index: int):
    """A model worker's answers: FETCH makes `n` samples from first_id (one sequence of index+1
    tokens each); RUN_MFC "fail_on_<index>" fails on that worker, any other answers an output key
    per id (its length the id), a count and a mean (the worker's index) over len(ids) sequences,
    and runs `then` after it."""
    if isinstance(msg, Fetch):
        ids = list(range(msg.first_id, msg.first_id + msg.n))
        return Fetched(ids, {"prompt": [index + 1 for _ in ids]}, {"prompt": [1 for _ in ids]}, [f"u{i}" for i in ids])
    if msg.mfc == f"fail_on_{index}":
        raise RuntimeError(f"MFC failed on worker {index}")
    key = f"{msg.mfc}_out"
    return MFCDone(msg.ids, {key: list(msg.ids)}, {key: [1] * len(msg.ids)}, {"count": len(msg.ids), "mean": float(index)},
                   len(msg.ids), seconds=0.1 * index, then=[answer_mfc(m, index) for m in msg.then])


@pytest.fixture
def node():
    made = []
    yield lambda n, **kw: made.append(Node(n, answer=answer_mfc, **kw)) or made[-1]
    for nd in made:
        nd.close()


def test_a_fetch_for_a_node_is_one_split_cut_per_worker(node):
    n = node(4)
    workers = [f"w{i}" for i in range(4)]
    got = wait_all(n.pool.request_columns([Columns(workers, [2, 2, 2, 2], Fetch(10, 8), [[], [7, 8], [], []])]), 10, "fetch")
    assert list(got) == ["w0"]  # one reply for the node, named by its first worker
    g = got["w0"]
    assert isinstance(g, Gathered) and g.workers == workers and g.sizes == [2, 2, 2, 2]
    assert g.reply.ids == list(range(10, 18)) and g.reply.uids == [f"u{i}" for i in range(10, 18)]
    assert g.reply.tokens == {"prompt": [1, 1, 2, 2, 3, 3, 4, 4]} and g.reply.seqs == {"prompt": [1] * 8}
    assert g.owners({w: i for i, w in enumerate(workers)}) == [0, 0, 1, 1, 2, 2, 3, 3]
    # each worker got its own Fetch, with its own released samples to drop
    assert [h for h in n.handled] == [[Fetch(10 + 2 * i, 2, clear=[7, 8] if i == 1 else [])] for i in range(4)]
    # the workers heard w0's relay, not the master
    assert all(k.startswith("w0/relay#") for s in n.servers[1:] for k in s.endpoint.guard._senders)
    assert not n.pool._pending


def test_an_mfc_and_its_chain_are_cut_per_worker_and_joined_in_order(node):
    n = node(3)
    ids, owner = [0, 3, 4, 6, 7], [0, 1, 1, 2, 2]
    msg = RunMFC("ref", ids, {"prompt": owner}, then=[RunMFC("train", ids, {"ref_out": owner})])
    g = wait_all(n.pool.request_columns([Columns(["w0", "w1", "w2"], [1, 2, 2], msg, [[], [5], []])]), 10, "mfc")["w0"]
    assert g.sizes == [1, 2, 2]
    assert g.reply.ids == ids and g.reply.tokens == {"ref_out": ids} and g.reply.seqs == {"ref_out": [1] * 5}
    # counts summed, means weighted by each worker's sequences, the slowest worker's time
    assert g.reply.stats == {"count": 5, "mean": (0 * 1 + 1 * 2 + 2 * 2) / 5} and g.reply.n == 5
    assert g.reply.seconds == pytest.approx(0.2)
    assert [t.ids for t in g.reply.then] == [ids] and g.reply.then[0].tokens == {"train_out": ids}
    for i, mine in enumerate([[0], [3, 4], [6, 7]]):  # each worker ran exactly its own request
        assert n.handled[i] == [RunMFC("ref", mine, {"prompt": [i] * len(mine)}, clear=[5] if i == 1 else [],
                                       then=[RunMFC("train", mine, {"ref_out": [i] * len(mine)})])]


def test_requests_that_do_not_cut_are_refused_before_anything_is_sent(node):
    n = node(3)
    good = Columns(["w0", "w1"], [1, 1], Fetch(0, 2), [[], []])
    for bad, why in [(Columns(["w0", "w1"], [1, 2], Fetch(0, 2), [[], []]), "a Fetch of 2 samples cut into"),
                     (Columns(["w0"], [2], RunMFC("a", [0, 1], {"k": [0]}), [[]]), r"owners of \['k'\] not one per id"),
                     (Columns(["w0", "w1"], [1, 1], RunMFC("a", [0, 1], {}, then=[RunMFC("b", [0], {})]), [[], []]), "RunMFC b"),
                     (Columns(["w0", "w1"], [2], Fetch(0, 2), [[], []]), "2 workers, 1 sizes")]:
        with pytest.raises(ValueError, match=why):
            n.pool.request_columns([good, bad])
    assert not n.pool._pending and not any(n.handled)


def test_a_failing_worker_fails_the_split_naming_it(node):
    n = node(3)
    with pytest.raises(RemoteError, match="^w2: MFC failed on worker 2"):
        wait_all(n.pool.request_columns([Columns(["w0", "w1", "w2"], [1, 1, 1], RunMFC("fail_on_2", [0, 1, 2], {}),
                                                 [[], [], []])]), 10, "mfc")
    assert not n.pool._pending


def test_a_silent_worker_fails_the_split_at_the_relays_deadline(node):
    n = node(3, relay_timeout_s=0.5, delays={1: 2.0})
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="^w1: relay: no reply within the relay's timeout"):
        wait_all(n.pool.request_columns([Columns(["w0", "w1", "w2"], [1, 1, 1], Fetch(0, 3), [[], [], []])]), 10, "fetch")
    assert time.monotonic() - t0 < 1.9


def test_a_lost_worker_fails_the_split_it_is_in(node):
    n = node(3, heartbeat_timeout_s=0.5, delays={2: 3.0})
    futs = n.pool.request_columns([Columns(["w0", "w1", "w2"], [1, 1, 1], Fetch(0, 3), [[], [], []])])
    time.sleep(0.2)
    n.servers[1]._close_by = 0  # w1's I/O thread stops: no more heartbeats from it
    n.servers[1]._stop.set()
    with pytest.raises(WorkerLost, match="^w1: no heartbeat"):
        futs["w0"].result(10)


# --- the columns themselves ------------------------------------------------------------------------


def test_cut_gives_each_worker_its_own_request():
    mine = [RunMFC("a", [5, 6], {"k": [1, 1]}, clear=[1], then=[RunMFC("b", [5, 6], {"o": [0, 0]})]),
            RunMFC("a", [7], {"k": [2]}, then=[RunMFC("b", [7], {"o": [1]})])]
    msg = RunMFC("a", [5, 6, 7], {"k": [1, 1, 2]}, then=[RunMFC("b", [5, 6, 7], {"o": [0, 0, 1]})])
    for k, m in enumerate(mine):
        got = columns.cut(int(Cmd.RUN_MFC), to_body(msg), [2, 1], [[1], []], k)
        assert parse(RunMFC, got) == m
    assert columns.cut(int(Cmd.FETCH), to_body(Fetch(10, 5, version=3)), [2, 3], [[], [4]], 1) == \
        {"first_id": 12, "n": 3, "version": 3, "clear": [4]}
    with pytest.raises(ValueError):
        columns.cut(int(Cmd.RUN_MFC), to_body(msg), [2, 2], [[], []], 0)


def test_a_top_cuts_its_split_into_one_split_per_relay():
    """A relay of relays' SPLIT (with `relays`): each relay gets its run of workers, their samples
    (ids following on) and their own clears, under the relays' deadline; counts that do not add up
    are refused."""
    ctx = zmq.Context()
    top = NodeRelay(ctx, b"t" * 32, "top", lambda peer, header: None)
    try:
        msg = Split(int(Cmd.FETCH), ["a", "b", "c"], [1, 2, 1], to_body(Fetch(10, 4, version=2)), [[], [5], []], 9.0,
                    relays=[("ra", 2), ("rc", 1)], relay_timeout_s=3.0)
        subs = top._per_relay(msg)
        assert [address for address, _ in subs] == ["ra", "rc"]
        bodies = [parse(Split, h["body"]) for _, h in subs]
        assert [(b.workers, b.sizes, b.clears, b.timeout_s, b.relays) for b in bodies] == [
            (["a", "b"], [1, 2], [[], [5]], 3.0, []), (["c"], [1], [[]], 3.0, [])]
        assert [(b.body["first_id"], b.body["n"], b.body["version"]) for b in bodies] == [(10, 3, 2), (13, 1, 2)]
        for bad in ([("ra", 2)], [("ra", 3), ("rc", 0)]):
            with pytest.raises(ValueError, match="relays serve"):
                top._per_relay(Split(msg.cmd, msg.workers, msg.sizes, msg.body, msg.clears, 9.0, relays=bad))
    finally:
        top.sock.close(0)
        ctx.term()


def test_join_refuses_replies_that_do_not_line_up():
    a = to_body(MFCDone([1], {"x": [3]}, {"x": [1]}, {}, 1))
    b = to_body(MFCDone([2], {"y": [3]}, {"y": [1]}, {}, 1))
    with pytest.raises(ValueError, match="different tokens keys"):
        columns.join(int(Cmd.RUN_MFC), [a, b])
    c = to_body(MFCDone([2, 3], {"x": [3, 4]}, {"x": [1]}, {}, 2))
    with pytest.raises(ValueError, match="1 entries for 2 samples"):
        columns.join(int(Cmd.RUN_MFC), [a, c])
    empty = to_body(Fetched([], {}, {}, []))  # a worker with nothing to give may name no keys
    joined = columns.join(int(Cmd.FETCH), [to_body(Fetched([1], {"p": [2]}, {"p": [1]}, ["u"])), empty])[1]
    assert joined["tokens"] == {"p": [2]} and joined["seqs"] == {"p": [1]}


def test_merged_groups_merge_as_all_workers_at_once():
    parts = [({"c": 1, "m": 0.5}, 2), ({"c": 2, "m": 1.0}, 1), ({"c": 4}, 3), ({"m": 0.25, "c": 0}, 4)]
    whole = columns.merged_stats(parts)
    halves = columns.merged_stats([(columns.merged_stats(parts[:2]), 3), (columns.merged_stats(parts[2:]), 7)])
    assert whole == pytest.approx(halves) and whole["c"] == 7 and type(halves["c"]) is int
