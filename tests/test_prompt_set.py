"""The master's record of trained prompts (batch_source.PromptSet): exactly a set's answers, in
memory that grows with the gaps in each rollout worker's seqs, not with the run's length."""

import random

from realcore.trainer.batch_source import PromptSet


def test_answers_as_a_set_does_in_any_order():
    rng = random.Random(0)
    for _ in range(200):
        ours, ref = PromptSet(), set()
        for _ in range(300):  # stream uids out of order, repeats, dataset uids, odd names
            uid = rng.choice([f"r{rng.randint(0, 2)}:{rng.randint(0, 60)}", f"d0:{rng.randint(0, 5)}", f"r1:x{rng.randint(0, 3)}"])
            assert (uid in ours) == (uid in ref), uid
            ours.add(uid)
            ref.add(uid)
            assert len(ours) == len(ref)
        assert all((f"r{w}:{q}" in ours) == (f"r{w}:{q}" in ref) for w in range(3) for q in range(-1, 70))


def test_memory_grows_with_the_gaps_not_with_the_prompts():
    skipped = {500, 70_000}  # e.g. dropped as too stale: never trained
    trained = PromptSet(f"r{w}:{q}" for w in range(2) for q in range(100_000) if q not in skipped)
    assert len(trained) == 2 * (100_000 - len(skipped))
    assert trained.stored() == 2 * (len(skipped) + 1)
    assert "r0:500" not in trained and "r1:70000" not in trained and "r1:69999" in trained and "r0:100000" not in trained
