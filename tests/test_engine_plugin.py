"""A fourth generation engine is one client module with its capabilities and nothing else: a user
file registers engine "fourth" (a client of the built-in server's API under another name, with
capabilities of its own and a command that starts `python -m realcore.serve`), and a short async
run names it in allocation_mode. Its requests went through that client (it counts them in a file),
and validation reads its capabilities (disk updates only), not its name."""

import os
import subprocess
import sys
import textwrap

import pytest

from test_e2e_async import async_cmd
from test_e2e_sync import assert_all_gone, assert_clean_logs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FOURTH = textwrap.dedent('''
    import os
    import sys

    from realcore.api.generation import Capabilities
    from realcore.api.registry import register_engine
    from realcore.backends.clients.sglang_api import GenClient

    CALLS = os.environ["FOURTH_CALLS"]


    def command(spec):
        """The built-in server, started as an external engine's server would be."""
        argv = [spec.python or sys.executable, "-m", "realcore.serve", "--model-path", spec.model_path,
                "--host", spec.host, "--port", str(spec.port), "--random-seed", str(spec.seed),
                "--max-running-requests", str(spec.max_batch_size), "--device", "cuda" if spec.cuda else "cpu"]
        return argv, {"REALCORE_API_KEY": spec.api_key} if spec.api_key else {}


    def available(python):
        return None


    @register_engine("fourth", command=command, available=available)
    class FourthClient(GenClient):
        capabilities = Capabilities(weight_updates=frozenset({"disk"}))

        def _count(self, what):
            with open(CALLS, "a") as f:  # one short line per call: appends of several processes do not mix
                f.write(f"{os.getpid()} {what}\\n")

        async def generate(self, input_ids, sampling_params, *, rid, return_logprob=True):
            self._count("generate")
            return await super().generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob)

        async def update_weights_from_disk(self, path, version, **abort):
            self._count("update_weights_from_disk")
            return await super().update_weights_from_disk(path, version, **abort)
''')


def user_file(tmp_path, monkeypatch) -> str:
    (tmp_path / "fourth_engine.py").write_text(FOURTH)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FOURTH_CALLS", str(tmp_path / "calls.txt"))
    if str(tmp_path) not in sys.path:
        monkeypatch.syspath_prepend(str(tmp_path))
    return "imports=[fourth_engine]"


def test_every_registered_client_speaks_the_contract():
    from realcore.api.generation import Capabilities, GenerationClient
    from realcore.api.registry import lookup, registered
    from realcore.backends.clients import registry

    calls = [m for m in vars(GenerationClient) if not m.startswith("_") and callable(getattr(GenerationClient, m))]
    assert {"generate", "pause", "update_weights_from_disk", "assume_version"} <= set(calls)
    assert {"local", "sglang", "vllm"} <= set(registered("engine"))
    for name in registered("engine"):
        client = lookup("engine", name).client
        assert isinstance(client.capabilities, Capabilities), name
        assert [m for m in calls if not callable(getattr(client, m, None))] == [], name
    assert registry.capabilities("vllm").reports_versions is False and registry.capabilities("local").own_worker


def test_validation_reads_the_fourth_engines_capabilities(tmp_path, monkeypatch):
    from realcore.launch.config_loader import ConfigError, load_config
    from realcore.launch.validate import validate

    base = ["experiment=async-ppo-math", "model=tiny", f"model.cache_dir={tmp_path}/cache", f"output_dir={tmp_path}/run"]
    with pytest.raises(ConfigError, match="unknown generation engine 'fifth'; registered: .*local.*sglang.*vllm"):
        validate(load_config([*base, "allocation_mode=fifth.d1+d1"]))
    imports = user_file(tmp_path, monkeypatch)
    validate(load_config([*base, imports, "allocation_mode=fourth.d1+d1"]))
    for refused, why in (("rollout.weight_update=memory", "memory works with built-in servers only"),
                         ("rollout.weight_update=nccl", "nccl works with"),
                         ("rollout.inflight_weight_update=true", "needs built-in servers"),
                         ("actor.lora={rank:4}", "actor.lora: LoRA runs"),
                         ("allocation_mode=fourth.d1c2+d1", "take dN, pN and tN only")):
        with pytest.raises(ConfigError, match=why):
            validate(load_config([*base, imports, "allocation_mode=fourth.d1+d1", refused]))


def test_a_short_async_run_on_a_fourth_engine_from_a_user_file(tmp_path, monkeypatch):
    imports = user_file(tmp_path, monkeypatch)
    out, cmd = async_cmd(tmp_path, imports, "allocation_mode=fourth.d1p1t1+d1p1t1", "rollout.n_workers=1",
                         "system.startup_timeout_s=180", steps=2)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = [line for line in open(out / "metrics.jsonl") if line.strip()]
    assert len(metrics) == 2
    assert_all_gone(str(out))
    assert_clean_logs(str(out), r.stdout, r.stderr)
    calls = [line.split() for line in open(tmp_path / "calls.txt")]
    generated = [pid for pid, what in calls if what == "generate"]
    updated = [pid for pid, what in calls if what == "update_weights_from_disk"]
    assert len(generated) >= 2 * 4 and updated, calls  # the rollouts (2 steps of 4), and the manager's updates
    assert set(generated).isdisjoint(updated)  # the rollout worker generates, the manager updates
