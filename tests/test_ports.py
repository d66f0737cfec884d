"""The weight plans, batch sources and worker state run on the ports handed to them, with no master
or model worker behind: stand-in ports record what each asks for."""

import os

import torch

from realcore.trainer import worker_state
from realcore.trainer.batch_source import DatasetSource, SourcePorts, StreamSource
from realcore.transport.protocol import (BroadcastWeights, Fetched, Pause, Published, PublishWeights, Resolve,
                                         UpdateWeights)
from realcore.transport.stream import Group
from realcore.weights.sync import WeightPorts, make_weight_sync

ADDRESSES = {"http": ["h0", "h1"], "weights": ["w0", "w1"]}


def _weight_ports(calls: list, tmp_path, manager: bool) -> WeightPorts:
    def call_workers(msg, what):
        calls.append(("workers", msg))
        return {"model_worker/0": Published(failed=[])}

    def call_manager(msg, what):
        calls.append(("manager", msg))

    return WeightPorts(call_workers=call_workers, call_manager=call_manager if manager else None,
                       server_addresses=lambda kind: ADDRESSES[kind], weights_dir=str(tmp_path / "weights"))


def test_disk_weights_sync_tells_the_servers_async_tells_the_manager(tmp_path):
    calls: list = []
    make_weight_sync("disk", _weight_ports(calls, tmp_path, manager=False)).publish(3)
    path = str(tmp_path / "weights" / "v3")
    assert calls == [("workers", PublishWeights(3, path=path, http=["h0", "h1"]))]
    calls.clear()
    plan = make_weight_sync("disk", _weight_ports(calls, tmp_path, manager=True))
    plan.publish(3)
    assert calls == [("workers", PublishWeights(3, path=path)), ("manager", UpdateWeights(3, path=path))]
    assert plan.path == path


def test_memory_and_nccl_weights_push_then_update_and_catch_up_once(tmp_path):
    calls: list = []
    plan = make_weight_sync("memory", _weight_ports(calls, tmp_path, manager=True))
    plan.publish(2)
    assert calls == [("workers", PublishWeights(2, servers=["w0", "w1"])), ("manager", UpdateWeights(2))]
    calls.clear()
    plan.catch_up([1], 2)
    plan.catch_up([1], 2)  # pushed already, a moment ago
    assert calls == [("workers", PublishWeights(2, servers=["w1"]))]
    calls.clear()
    make_weight_sync("nccl", _weight_ports(calls, tmp_path, manager=True)).publish(4)
    assert calls == [("manager", Pause()), ("workers", BroadcastWeights(4, ["h0", "h1"])), ("manager", UpdateWeights(4))]


class _Buffer:
    def __init__(self):
        self.added: list = []

    def add(self, owners, ids, tokens, seqs):
        self.add_many([(owners, ids, tokens, seqs)])

    def add_many(self, items):
        self.added += items


def _source_ports(buffer, **calls) -> SourcePorts:
    none = lambda *a: None
    return SourcePorts(batch_size=4, timeout_s=5.0, heads=[0, 2], groups=[[0, 1]], buffer=buffer,
                       call_columns=calls.get("call_columns", none), call_worker=calls.get("call_worker", none),
                       clear=calls.get("clear", none), call_manager=calls.get("call_manager"),
                       version=lambda: 3, while_waiting=none)


def test_dataset_source_fetches_a_run_of_heads_in_one_request():
    sent: list = []

    def call_columns(runs, what):
        sent.extend(runs)
        (workers, sizes, msg), = runs
        ids = list(range(msg.first_id, msg.first_id + msg.n))
        owners = [w for w, n in zip(workers, sizes) for _ in range(n)]
        return [(owners, Fetched(ids, {"x": [1] * len(ids)}, {"x": [1] * len(ids)}, [f"d:{i}" for i in ids]))]

    buffer = _Buffer()
    source = DatasetSource(_source_ports(buffer, call_columns=call_columns))
    source.next_id = 10
    groups = source.fetch({})
    assert [(w, s, (m.first_id, m.n)) for w, s, m in sent] == [([0, 2], [2, 2], (10, 4))]
    assert [g.sid for g in groups] == [10, 11, 12, 13] and source.next_id == 14
    assert buffer.added[0][0] == [0, 0, 2, 2]


def test_stream_source_resolves_with_the_manager_and_clears_duplicates():
    asked, resolved, cleared = [], [], []
    replies = [["r0:0", "r0:1"], ["r0:1", "r1:0"], ["r0:2"]]  # r0:1 twice: a rollout that ran again

    def call_worker(i, msg, what):
        asked.append((i, msg.first_id, msg.n, msg.version))
        uids = replies[len(asked) - 1][:msg.n]
        k = len(uids)
        return Fetched(list(range(msg.first_id, msg.first_id + k)), {"x": [1] * k}, {"x": [1] * k}, uids,
                       grants=[len(asked) * 10 + j for j in range(k)], version_start=[[2]] * k,
                       version_end=[[3]] * k, rewards=[[1.0]] * k, prompt_lens=[[5]] * k,
                       response_lens=[[len(asked)]] * k)

    buffer = _Buffer()
    ports = _source_ports(buffer, call_worker=call_worker, clear=lambda i, ids: cleared.append((i, ids)),
                          call_manager=lambda msg, what: resolved.append(msg))
    source = StreamSource(ports)
    metrics: dict = {}
    groups = source.fetch(metrics)
    assert asked == [(0, 0, 4, 3), (2, 2, 2, 3), (0, 4, 1, 3)]
    assert resolved == [Resolve(trained=[10, 11]), Resolve(trained=[20, 21]), Resolve(trained=[30])]
    assert cleared == [(2, [2])]
    assert [g.uid for g in groups] == ["r0:0", "r0:1", "r1:0", "r0:2"] and source.next_id == 5
    assert metrics["staleness/duplicates"] == 1 and metrics["staleness/head"] == 1
    # The kept groups' lengths (r0:1 once): responses of 1, 1, 2 and 3 tokens after prompts of 5.
    assert (metrics["gen/response_len"], metrics["gen/response_len_max"], metrics["gen/prompt_len"],
            metrics["gen/response_tokens"]) == (7 / 4, 3.0, 5.0, 7)


class _Engine:
    def __init__(self):
        self.saved = self.loaded = None

    def save_state(self, folder):
        self.saved = folder

    def load_state(self, folder):
        self.loaded = folder


class _Sampler:
    seq = 0


class _Stream:
    keys = ("input_ids",)

    def __init__(self, groups=()):
        self.groups = list(groups)

    def snapshot(self):
        return list(self.groups)

    def restore(self, groups):
        self.groups = groups


def test_worker_state_saves_and_loads_only_the_parts_handed_in(tmp_path):
    engine, sampler = _Engine(), _Sampler()
    sampler.seq = 7
    group = Group("r0:3", 5, {"input_ids": [torch.arange(3), torch.arange(2)]})
    parts = worker_state.StateParts(1, engines={"actor": engine}, collective={"critic"}, sampler=sampler,
                                    stream=_Stream([group]))
    worker_state.save(parts, str(tmp_path))
    assert engine.saved == os.path.join(str(tmp_path), "model_worker-1", "actor")
    back_engine, back_sampler, back_stream = _Engine(), _Sampler(), _Stream()
    worker_state.load(worker_state.StateParts(1, engines={"actor": back_engine}, collective=set(), sampler=back_sampler,
                                              stream=back_stream), str(tmp_path))
    assert back_sampler.seq == 7 and back_engine.loaded == engine.saved
    (got,) = back_stream.groups
    assert (got.uid, got.grant) == ("r0:3", 5)
    assert [t.tolist() for t in got.sample["input_ids"]] == [[0, 1, 2], [0, 1]]
