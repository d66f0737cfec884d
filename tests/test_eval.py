"""Evaluation on held-out prompts: the metric arithmetic (a scripted engine), greedy determinism
on the built-in engine, and `python -m realcore.eval` end to end on the tiny model (also on a
run's folder: its last checkpoint with the run's settings)."""

import asyncio
import json
import os
import subprocess
import sys

import pytest

import realcore.data  # noqa: F401  (registers the datasets and rewards)
from realcore.api.config import EvalConfig, ExperimentConfig, GenerationConfig, MFCConfig, ModelConfig, SystemConfig
from realcore.api.registry import make_workflow
from realcore.api.workflow import Completion, RolloutEngine
from realcore.workflows.evaluate import eval_rows, evaluate
from tiny_models import spread_weights

METRICS = ("eval/accuracy", "eval/reward", "eval/n_prompts", "eval/response_len", "eval/failed", "eval/time_s")


def _cfg(**kw) -> ExperimentConfig:
    return ExperimentConfig(experiment_name="eval-test", output_dir="/nonexistent",
                            mfcs=[MFCConfig(name="gen", type="generate", model="actor")], **kw)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


# --- the metric arithmetic ------------------------------------------------------------------------


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class ScriptedEngine(RolloutEngine):
    """Answers prompt `[a]` (answer a): greedily right when a is even; sampled, the k-th sample
    right when a % 3 == 0 and k == 1. The answer has a + 1 tokens. Prompt 5 hangs when sampled."""

    def __init__(self, gconfig):
        self.tokenizer, self.gconfig, self.calls = _Tok(), gconfig, {}

    async def agenerate(self, input_ids, *, max_new_tokens=None, temperature=None, greedy=None, stop=None):
        a = input_ids[0]
        k = self.calls[a] = self.calls.get(a, -1) + 1
        if not self.gconfig.greedy and a == 5:
            await asyncio.Event().wait()  # never set: the pass's deadline must end it
        right = a % 2 == 0 if self.gconfig.greedy else (a % 3 == 0 and k == 1)
        text = str(a) if right else "wrong"
        return Completion([7] * (a + 1), [-0.5] * (a + 1), [0] * (a + 1), "stop", text)

    async def reward(self, prompt, completion, prompt_ids, completion_ids, **data):
        return 1.0 if completion == data["answer"] else -0.5


def test_metrics_from_a_scripted_engine():
    cfg = _cfg(eval=EvalConfig(n_samples=3, max_new_tokens=5, temperature=0.7),
               generation=GenerationConfig(max_new_tokens=32, temperature=1.0, n_samples=8),
               system=SystemConfig(request_timeout_s=1.0))
    rows = [{"prompt_ids": [a], "answer": str(a)} for a in range(8)]
    workflow = make_workflow("math-single-step", {})

    async def episode(engine, data):
        if engine.gconfig.greedy and data["answer"] == "7":
            return None  # rejected: counted as failed and scored 0
        if engine.gconfig.greedy and data["answer"] == "6":
            raise RuntimeError("boom")  # raised: counted as failed and scored 0
        return await workflow(engine, data)

    engines = []

    def make_engine(g):
        engines.append(ScriptedEngine(g))
        return engines[-1]

    m = asyncio.run(evaluate(cfg, episode, make_engine, rows))
    greedy, sampled = (e.gconfig for e in engines)
    assert (greedy.greedy, greedy.n_samples, greedy.max_new_tokens) == (True, 1, 5)
    assert (sampled.greedy, sampled.n_samples, sampled.max_new_tokens, sampled.temperature) == (False, 3, 5, 0.7)
    # Greedy: prompts 0, 2, 4 right (1.0); 1, 3, 5 wrong (-0.5); 6 raised, 7 rejected (0, failed).
    assert m["eval/accuracy"] == 3 / 8
    assert m["eval/reward"] == pytest.approx((3 * 1.0 + 3 * -0.5) / 8)
    # Sampled (3 each): prompts 0, 3 and 6 have one right sample; 5 hangs past the deadline (failed).
    assert m["eval/pass@3"] == 3 / 8
    assert m["eval/n_prompts"] == 8
    assert m["eval/response_len"] == (1 + 2 + 3 + 4 + 5 + 6) / 6  # the six greedy episodes that finished
    assert m["eval/failed"] == 3
    assert 1.0 <= m["eval/time_s"] < 10
    assert set(m) == {*METRICS, "eval/pass@3"}

    engines.clear()  # n_samples 0: the greedy pass only
    m = asyncio.run(evaluate(cfg.model_copy(update={"eval": EvalConfig(n_samples=0, max_new_tokens=5)}), episode,
                             make_engine, rows))
    assert len(engines) == 1 and engines[0].gconfig.greedy and set(m) == set(METRICS)
    assert m["eval/accuracy"] == 3 / 8 and m["eval/failed"] == 2


def test_eval_rows_are_a_new_draw_without_the_training_questions(cache):
    from realcore.api.config import DatasetConfig
    from realcore.api.registry import lookup
    from realcore.backends.models import load_tokenizer, prepare_model

    tok = load_tokenizer(prepare_model(ModelConfig(cache_dir=cache), seed=1))
    cfg = _cfg(dataset=DatasetConfig(type="tiny-arith", seed=3, size=64), eval=EvalConfig(n_prompts=10))
    rows = eval_rows(cfg, tok)
    assert len(rows) == 10 and all(isinstance(r["prompt_ids"], list) and isinstance(r["answer"], str) for r in rows)
    trained = {bytes(s["question"][0].tolist()).decode()
               for s in lookup("dataset", "tiny-arith")(cfg.dataset, tok, rank=0, world=1, use_chat_template=False).samples}
    every = eval_rows(cfg.model_copy(update={"eval": EvalConfig(n_prompts=64)}), tok)  # seed 3 + 64: a new draw
    assert every and not {r["question"] for r in every} & trained
    assert len(every) < 64  # the small space of tiny-arith repeats some training questions: left out
    # reasoning-gym seeds item i with seed + i: the default draw must not be the training set shifted by one
    gym = DatasetConfig(type="reasoning-gym", task="basic_arithmetic", size=40, seed=3,
                        task_kwargs={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2})
    assert len(eval_rows(_cfg(dataset=gym, eval=EvalConfig(n_prompts=40)), tok)) >= 36
    with pytest.raises(ValueError, match="also in the training dataset"):
        eval_rows(cfg.model_copy(update={"eval": EvalConfig(n_prompts=10, dataset=cfg.dataset)}), tok)
    with pytest.raises(ValueError, match="format=rl"):
        eval_rows(cfg.model_copy(update={"eval": EvalConfig(dataset=DatasetConfig(format="sft"))}), tok)



def test_holdout_keeps_its_questions_out_of_training_and_evaluation_sees_only_them(cache):
    from realcore.api.config import DatasetConfig
    from realcore.api.registry import lookup
    from realcore.backends.models import load_tokenizer, prepare_model
    from realcore.data.datasets import held_out

    tok = load_tokenizer(prepare_model(ModelConfig(cache_dir=cache), seed=1))
    load = lookup("dataset", "tiny-arith")
    whole = DatasetConfig(type="tiny-arith", seed=3, size=400)
    split = whole.model_copy(update={"holdout": 0.3})

    def questions(d):
        return {bytes(s["question"][0].tolist()).decode() for s in load(d, tok, rank=0, world=1, use_chat_template=False).samples}

    everything, trained = questions(whole), questions(split)
    out = everything - trained
    assert out and trained and all(held_out(q, 0.3) for q in out) and not any(held_out(q, 0.3) for q in trained)
    assert 0.15 < len(out) / len(everything) < 0.45
    # the same questions whatever the seed
    other = questions(split.model_copy(update={"seed": 4}))
    assert not any(held_out(q, 0.3) for q in other)
    # evaluation of the same task (the default: a new draw) sees only held-out questions, each once;
    # another task is not filtered
    rows = eval_rows(_cfg(dataset=split, eval=EvalConfig(n_prompts=1000)), tok)
    qs = [r["question"] for r in rows]
    assert qs and len(qs) == len(set(qs)) and all(held_out(q, 0.3) for q in qs)
    gym = DatasetConfig(type="reasoning-gym", task="basic_arithmetic", size=40, seed=3)
    assert len(eval_rows(_cfg(dataset=split, eval=EvalConfig(n_prompts=40, dataset=gym)), tok)) == 40

# --- the built-in engine --------------------------------------------------------------------------


def test_greedy_eval_on_the_built_in_engine_is_deterministic(cache):
    from realcore.backends.generation import GenerationEngine
    from realcore.backends.models import load_model, load_tokenizer, prepare_model
    from realcore.workflows.reward_runner import RewardCall, RewardRunner
    from realcore.workflows.engines import BatchingEngine

    path = prepare_model(ModelConfig(cache_dir=cache), seed=1)
    model, tok = load_model(path), load_tokenizer(path)
    spread_weights(model, seed=1)
    policy = GenerationEngine(model, tok, seed=1)
    batches = []
    generate = policy.generate
    policy.generate = lambda prompts, g: batches.append((len(prompts), g.greedy)) or generate(prompts, g)

    cfg = _cfg(model=ModelConfig(path=path), eval=EvalConfig(n_prompts=6, n_samples=2),
               generation=GenerationConfig(max_new_tokens=12))
    rows = eval_rows(cfg, tok)
    workflow = make_workflow("math-single-step", {})
    outputs = []

    async def episode(engine, data):
        group = await workflow(engine, data)
        if engine.gconfig.greedy:
            outputs.append((data["prompt_ids"], group[0]["input_ids"].tolist()))
        return group

    runner = RewardRunner("math", ["realcore.data"], timeout_s=30)

    async def reward_fn(prompt, completion, prompt_ids, completion_ids, row):
        return (await runner.ascore(RewardCall(prompt, completion, prompt_ids, completion_ids, row))).reward

    def make_engine(g):
        return BatchingEngine(policy, tok, g, reward_fn, version=0)

    try:
        runs = []
        for _ in range(2):
            outputs.clear()
            runs.append((asyncio.run(evaluate(cfg, episode, make_engine, rows)), sorted(outputs)))
    finally:
        runner.close()
    (m1, out1), (m2, out2) = runs
    assert len(out1) == 6 and out1 == out2
    assert len({tuple(ids) for _, ids in out1}) == 6  # not one degenerate answer for all
    for k in ("eval/accuracy", "eval/reward", "eval/response_len", "eval/failed", "eval/n_prompts"):
        assert m1[k] == m2[k], k
    assert m1["eval/failed"] == 0 and m1["eval/n_prompts"] == 6 and 0 < m1["eval/response_len"] <= 12
    # The episodes of a pass decode together: one batch of 6 greedy prompts, one of 6 x 2 samples.
    assert batches[:2] == [(6, True), (12, False)]


# --- the command line -----------------------------------------------------------------------------


def test_cli_prints_every_metric(cache, tmp_path):
    p = subprocess.run([sys.executable, "-m", "realcore.eval", "model=tiny", "dataset=tiny-arith", "eval.n_prompts=8",
                        "eval.n_samples=2", f"model.cache_dir={cache}"], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    metrics = json.loads(lines[-1])
    for k in (*METRICS, "eval/pass@2"):
        assert k in metrics, k
        assert any(line.split()[0] == k for line in lines[:-1]), f"{k} not in the table"
    assert metrics["eval/n_prompts"] == 8 and metrics["eval/failed"] == 0
    assert 0 <= metrics["eval/accuracy"] <= 1 and 0 <= metrics["eval/pass@2"] <= 1
    assert 0 < metrics["eval/response_len"] <= 16  # ppo-math's generation.max_new_tokens


@pytest.mark.parametrize("args, message", [
    (["model.path=/nonexistent/model"], "model.path: '/nonexistent/model' is not a directory holding config.json"),
    (["rollout.workflow=no-such-workflow"], "rollout.workflow: unknown workflow 'no-such-workflow'"),
    (["eval.n_prompts=0"], "eval.n_prompts: Input should be greater than 0"),
    (["--model", "x"], "--model: arguments are OUTPUT_DIR and/or key=value config overrides"),
])
def test_cli_bad_input_is_one_line_exit_2(args, message, capsys):
    from realcore.eval import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


# --- a run's folder -------------------------------------------------------------------------------

# Settings that differ from ppo-math's defaults, so that the run's own must be read from its config.json.
RUN_SETTINGS = ["dataset.holdout=0.5", "seed=5", "generation.max_new_tokens=6", "eval.n_prompts=5", "eval.n_samples=2"]


def _figures(stdout: str) -> tuple[str, dict[str, float]]:
    """(header line, every metric but the wall time) of realcore.eval's output."""
    lines = stdout.strip().splitlines()
    return lines[0], {k: v for k, v in json.loads(lines[-1]).items() if k != "eval/time_s"}


def test_cli_on_a_run_folder_evaluates_its_last_checkpoint_with_its_settings(cache, tmp_path, capsys):
    from realcore.eval import main

    out = tmp_path / "run"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "realcore.launch", "experiment=ppo-math", "model=tiny", "trainer.total_steps=2",
                        "trainer.batch_size=4", "generation.n_samples=2", "eval.freq_steps=2", *RUN_SETTINGS,
                        f"model.cache_dir={cache}", f"output_dir={out}", f"system.name_resolve.root={out}/nr",
                        "trial_name=eval-run-folder"], cwd=repo, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2"]  # saved at the last step only
    p = subprocess.run([sys.executable, "-m", "realcore.eval", str(out)], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    header, by_folder = _figures(p.stdout)
    assert str(out / "checkpoints" / "step_2") in header, header
    assert by_folder["eval/n_prompts"] == 5 and "eval/pass@2" in by_folder
    assert 0 < by_folder["eval/response_len"] <= 6
    # the run's own evaluation after its last step
    (in_run,) = [m for m in map(json.loads, open(out / "metrics.jsonl")) if m["step"] == 2 and "eval/accuracy" in m]
    assert {k: in_run[k] for k in by_folder if k.startswith("eval/")} == {k: v for k, v in by_folder.items() if k.startswith("eval/")}
    # the key=value form, given the run's settings by hand, prints the same figures
    assert main(["experiment=ppo-math", "model=tiny", f"model.path={out}/checkpoints/step_2", *RUN_SETTINGS,
                 f"model.cache_dir={cache}"]) == 0
    assert _figures(capsys.readouterr().out) == (header, by_folder)
    # overrides after the folder change the run's settings
    assert main([str(out), "eval.n_prompts=3", "eval.n_samples=0"]) == 0
    _, fewer = _figures(capsys.readouterr().out)
    assert fewer["eval/n_prompts"] == 3 and "eval/pass@2" not in fewer


def test_cli_bad_run_folder_is_one_line_exit_2(tmp_path, capsys):
    from realcore.eval import main
    from realcore.launch.config_loader import load_config

    empty = tmp_path / "empty"
    empty.mkdir()
    untrained = tmp_path / "untrained"  # a run's config, no checkpoint yet
    untrained.mkdir()
    (untrained / "config.json").write_text(load_config(["experiment=ppo-math", f"output_dir={untrained}"]).model_dump_json())
    for args, message in [([str(tmp_path / "nowhere")], "no such run folder"),
                          ([str(empty)], "no config.json (not a run's output folder)"),
                          ([str(untrained)], "no checkpoint (checkpoints/step_N) in this run folder"),
                          ([str(untrained), "eval.no_such_key=1"], "eval.no_such_key: not a key of the run config"),
                          ([str(untrained), "eval.n_prompts=0"], "eval.n_prompts: Input should be greater than 0")]:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
