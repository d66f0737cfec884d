"""Published addresses (realcore.transport.addresses): what each process writes is what the others
read, as the JSON tools and tests read it; a restarted manager is noticed once it has published."""

import json

import pytest

from realcore.api.config import ExperimentConfig, MFCConfig
from realcore.transport import addresses, keys
from realcore.transport.name_resolve import make_name_resolver

SECRET = b"s" * 32


def _cfg(tmp_path) -> ExperimentConfig:
    return ExperimentConfig(experiment_name="addresses", trial_name=tmp_path.name, output_dir=str(tmp_path),
                            mfcs=[MFCConfig(name="n", type="t")], system={"name_resolve": {"root": str(tmp_path / "names")}})


def test_each_kind_reads_back_what_was_published_as_the_same_json(tmp_path):
    cfg = _cfg(tmp_path)
    r = make_name_resolver(cfg.system.name_resolve, SECRET)
    head = addresses.ModelWorkerAddress("tcp://h:1", "tcp://h:2", 11, stream="tcp://h:3")
    other = addresses.ModelWorkerAddress("tcp://h:4", "tcp://h:5", 12)
    addresses.publish_model_worker(r, cfg, 0, head)
    addresses.publish_model_worker(r, cfg, 1, other)
    addresses.publish_manager(r, cfg, addresses.ManagerAddress("tcp://h:6", 13))
    addresses.publish_gen_server(r, cfg, 0, addresses.GenServerAddress("http://h:7", "tcp://h:8"))
    addresses.publish_gen_server(r, cfg, 1, addresses.GenServerAddress("http://h:9"))
    assert addresses.read_model_worker(r, cfg, 0) == head
    assert addresses.read_model_worker(r, cfg, 1, timeout_s=1.0) == other
    assert addresses.read_manager(r, cfg) == addresses.ManagerAddress("tcp://h:6", 13)
    assert addresses.read_gen_servers(r, cfg) == {0: addresses.GenServerAddress("http://h:7", "tcp://h:8"),
                                                  1: addresses.GenServerAddress("http://h:9", None)}
    # The JSON as it always was: a model worker without a stream has no "stream"; "weights" is null.
    assert json.loads(r.get(keys.model_worker(cfg, 1))) == {"control": "tcp://h:4", "data": "tcp://h:5", "pid": 12}
    assert json.loads(r.get(keys.gen_server(cfg, 1))) == {"http": "http://h:9", "weights": None}
    r.put(keys.manager(cfg), json.dumps({"control": "tcp://h:10"}), replace=True)  # written by hand, as tests do
    assert addresses.read_manager(r, cfg) == addresses.ManagerAddress("tcp://h:10")
    r.put(keys.manager(cfg), json.dumps({"pid": 1}), replace=True)
    with pytest.raises(ValueError, match="ManagerAddress"):
        addresses.read_manager(r, cfg)


def test_a_restarted_manager_is_noticed_once_it_published(tmp_path):
    cfg = _cfg(tmp_path)
    r = make_name_resolver(cfg.system.name_resolve, SECRET)
    assert addresses.manager_moved(r, cfg, "tcp://old:1") is None  # nothing published yet
    with pytest.raises(KeyError):
        addresses.read_manager(r, cfg)
    addresses.publish_manager(r, cfg, addresses.ManagerAddress("tcp://old:1", 1))
    assert addresses.manager_moved(r, cfg, "tcp://old:1") is None
    addresses.publish_manager(r, cfg, addresses.ManagerAddress("tcp://new:2", 2))
    assert addresses.manager_moved(r, cfg, "tcp://old:1") == "tcp://new:2"
    assert addresses.manager_moved(r, cfg, "tcp://new:2") is None
