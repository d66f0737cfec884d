"""Agentic RL end to end, with real processes (launcher, master, model worker, generation server,
rollout worker):

- a multi-turn agent written in a user's own file (workflow + environment + a checking MFC) trains in
  async mode; what reaches the trainer has loss_mask 0 exactly on the environment's feedback tokens,
  its declared extra key rides the stream, and its behaviour log-probs equal the trainer's own
  recomputation (prox_logprobs) for the sequences the current policy generated;
- the built-in experiments async-multi-turn-math and async-tool-math run with evaluation rows.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model=tiny", "dataset=tiny-arith"]

USER_FILE = textwrap.dedent('''
    """A user's agent: answer; a wrong answer hears FEEDBACK and tries again (max_turns turns)."""
    import json, os
    import torch
    from realcore.api.registry import MFCSpec, register_env, register_mfc, register_workflow
    from realcore.api.workflow import TRAJECTORY_KEYS, Env, TrajectoryBuilder

    FEEDBACK = " WRONG! again:"


    @register_env("guess")
    class Guess(Env):
        def __init__(self, reward):
            self.reward = reward

        async def reset(self, data):
            self.data = data
            return ""

        async def step(self, action):
            d = self.data
            r = await self.reward("", action.text, d["prompt_ids"], action.output_ids, answer=d["answer"])
            return FEEDBACK, r, r > 0, {}


    @register_workflow("guess-agent", keys=TRAJECTORY_KEYS + ("n_turns",))
    async def guess_agent(engine, data, max_turns=2):
        out = []
        for _ in range(engine.gconfig.n_samples):
            env = Guess(engine.reward)
            await env.reset(data)
            t = TrajectoryBuilder(data["prompt_ids"])
            for turn in range(max_turns):
                c = await engine.agenerate(t.ids, max_new_tokens=6)
                t.add_completion(c)
                obs, reward, done, _ = await env.step(c)
                if done or turn == max_turns - 1:
                    break
                t.add_observation(engine.tokenizer.encode(obs, add_special_tokens=False))
            out.append(t.to_tensors(reward, n_turns=torch.tensor([turn + 1])))
        return out


    @register_workflow("chat-agent", keys=TRAJECTORY_KEYS + ("n_turns",))
    async def chat_agent(engine, data, max_turns=2):
        """The same agent written against the OpenAI API: two chat turns through ChatClient."""
        from realcore.workflows.openai_client import ChatClient

        out = []
        for _ in range(engine.gconfig.n_samples):
            client = ChatClient(engine)
            messages = [{"role": "user", "content": data["question"]}]
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            answer = reply.choices[0].message.content
            r = await engine.reward("", answer, data["prompt_ids"], [], answer=data["answer"])
            turns = 1
            if r <= 0 and max_turns > 1:
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": FEEDBACK}]
                reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
                r = await engine.reward("", reply.choices[0].message.content, data["prompt_ids"], [], answer=data["answer"])
                turns = 2
            out.append({**client.trajectory(r), "n_turns": torch.tensor([turns])})
        return out


    @register_mfc("record_trajectories")
    class Record:
        """Writes what the trainer receives, and the trainer's recomputed log-probs, to a file."""
        spec = MFCSpec(needs_model=False)

        def __init__(self, cfg, mfc):
            self.path, self.calls = os.path.join(cfg.output_dir, "trained.jsonl"), 0

        def run(self, model, batch):
            self.calls += 1
            feedback = model.tokenizer.encode(FEEDBACK, add_special_tokens=False)
            with open(self.path, "a") as f:
                for s in batch.samples:
                    for i in range(len(s["input_ids"])):
                        f.write(json.dumps({
                            "step": self.calls, "feedback": feedback, "ids": s["input_ids"][i].tolist(),
                            "mask": s["loss_mask"][i].tolist(), "behav": s["behav_logprobs"][i].tolist(),
                            "prox": s["prox_logprobs"][i].tolist(), "v0": int(s["version_start"][i]),
                            "v1": int(s["version_end"][i]), "n_turns": int(s["n_turns"][i])}) + "\\n")
            return {"record/n": len(batch.flat("input_ids"))}
''')

USER_EXPERIMENT = textwrap.dedent('''
    # @package _global_
    defaults:
      - async-ppo-math
    experiment_name: guess
    eval: {freq_steps: null}
    imports: [user_agent]
    rollout: {workflow: guess-agent, workflow_kwargs: {max_turns: 2}, max_head_offpolicyness: 0}
    mfcs:
      - {name: actor_inf, type: inference, model: actor, inputs: [input_ids], outputs: [logprobs], output_remap: {logprobs: prox_logprobs}}
      - {name: record, type: record_trajectories, inputs: [input_ids, loss_mask, behav_logprobs, prox_logprobs, version_start, version_end, n_turns]}
      - {name: actor_train, type: ppo_update, model: actor, inputs: [input_ids, loss_mask, behav_logprobs, rewards, prox_logprobs]}
''')


def run(args: list[str], out: str, cwd: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "realcore.launch", *args, *TINY, f"output_dir={out}",
           f"model.cache_dir={os.path.dirname(out)}/cache", f"system.name_resolve.root={out}-nr"]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def expected_mask(ids: list[int], first: int, feedback: list[int]) -> tuple[list[int], int]:
    """1 after the prompt, 0 wherever the feedback's tokens are; and how many feedbacks there are."""
    mask, n, i = [0] * first + [1] * (len(ids) - first), 0, first
    while i + len(feedback) <= len(ids):
        if ids[i:i + len(feedback)] == feedback:
            mask[i:i + len(feedback)] = [0] * len(feedback)
            n, i = n + 1, i + len(feedback)
        else:
            i += 1
    return mask, n


def run_user_agent(tmp_path, *overrides: str) -> tuple[str, list[dict]]:
    """Train the user's agent from its own file and experiment; its output dir and what it trained on."""
    (tmp_path / "user_agent.py").write_text(USER_FILE)
    (tmp_path / "exps" / "experiment").mkdir(parents=True)
    (tmp_path / "exps" / "experiment" / "guess.yaml").write_text(USER_EXPERIMENT)
    out = str(tmp_path / "run")
    run([f"hydra.searchpath=[file://{tmp_path}/exps]", "experiment=guess", "trainer.batch_size=4", "generation.n_samples=2",
         *overrides], out, cwd=str(tmp_path))
    return out, [json.loads(x) for x in open(os.path.join(out, "trained.jsonl"))]


@pytest.mark.timeout(900)
def test_a_users_multi_turn_agent_trains_and_its_feedback_is_not_trained_on(tmp_path):
    out, rows = run_user_agent(tmp_path, "trainer.total_steps=4")
    assert len(rows) == 4 * 4 * 2 and {r["step"] for r in rows} == {1, 2, 3, 4}
    multi = 0
    for r in rows:
        first = r["mask"].index(1)
        mask, n_feedback = expected_mask(r["ids"], first, r["feedback"])
        assert r["mask"] == mask, r  # token by token: feedback 0, the policy's tokens 1
        assert n_feedback == r["n_turns"] - 1  # the declared extra key came through the stream
        multi += r["n_turns"] > 1
        assert all(b == 0 for b, m in zip(r["behav"], r["mask"]) if not m)
    assert multi > 0, "no episode had a second turn: the test proves nothing"
    # Sequences generated wholly by the policy that trains on them (eta = 0: most): the server's
    # behaviour log-probs are the trainer's own recomputation, token by token.
    same = [r for r in rows if r["v0"] == r["v1"] == r["step"] - 1]
    assert len(same) >= len(rows) // 2, [(r["step"], r["v0"], r["v1"]) for r in rows]
    worst = max(abs(b - p) for r in same for b, p, m in zip(r["behav"], r["prox"], r["mask"]) if m)
    assert worst < 1e-3, worst
    metrics = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all(m["record/n"] == 8 for m in metrics)


def mask_runs(mask: list[int]) -> int:
    """How many separate stretches of trained tokens a sequence has."""
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


@pytest.mark.timeout(900)
def test_an_agent_written_against_the_openai_api_trains(tmp_path):
    _, rows = run_user_agent(tmp_path, "rollout.workflow=chat-agent", "trainer.total_steps=3")
    assert len(rows) == 3 * 4 * 2
    assert any(r["n_turns"] == 2 for r in rows)
    for r in rows:  # each reply trained on, the chat glue and the feedback between them not
        assert mask_runs(r["mask"]) == r["n_turns"], r


@pytest.mark.timeout(900)
@pytest.mark.parametrize("experiment", ["async-multi-turn-math", "async-tool-math"])
def test_agentic_experiments_run_with_evaluation(tmp_path, experiment):
    out = str(tmp_path / "run")
    run([f"experiment={experiment}", "trainer.total_steps=5", "eval.freq_steps=2", "eval.n_prompts=8",
         "eval.n_samples=2"], out, cwd=REPO)
    metrics = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5]
    evaluated = [m["step"] for m in metrics if "eval/accuracy" in m]
    assert evaluated == [0, 2, 4, 5]  # the base policy, every 2 steps and after the last
    for m in metrics:
        if "eval/accuracy" in m:
            assert m["eval/n_prompts"] == 8 and m["eval/failed"] == 0 and "eval/pass@2" in m
