"""The addition task: tokenizer, fixed-width problems, held-out set, reward, SFT batches."""

from __future__ import annotations

import json

import pytest
import torch

from rl.tasks.kinds.arithmetic import BOS, EOS, PAD, AdditionTask, Problem, decode, encode


def test_encode_decode_round_trip() -> None:
    """Every character of the task survives encode -> decode, and ids avoid PAD/BOS/EOS."""
    text = "0123456789+="
    ids = encode(text)
    assert len(ids) == len(text)
    assert len(set(ids)) == len(text)
    assert not {PAD, BOS, EOS} & set(ids)
    assert decode(ids) == text


def test_encode_rejects_unknown_character() -> None:
    """A character outside the vocab is a bug upstream, not something to skip silently."""
    with pytest.raises(ValueError, match="'x'"):
        encode("1x2")


def test_decode_stops_at_eos_and_marks_unknown_ids() -> None:
    """Sampled responses run past EOS; only the text before it counts."""
    assert decode([*encode("12"), EOS, *encode("34")]) == "12"
    assert decode([*encode("1"), 99, *encode("2")]) == "1?2"


def test_prompt_and_answer_are_zero_padded() -> None:
    """Fixed width keeps batches free of padding (RoPE positions must not shift)."""
    p = Problem(7, 35)
    prompt = p.prompt(2)
    assert prompt[0] == BOS
    assert decode(prompt[1:]) == "07+35="
    answer = p.answer(2)
    assert answer[-1] == EOS
    assert decode(answer) == "042"
    assert len(answer) == 4


def test_all_problems_of_a_task_have_the_same_lengths() -> None:
    """prompt_len/answer_len are what the trainer slices on; they must hold for any a, b."""
    task = AdditionTask(digits=3, seed=0, eval_size=16)
    for p in [Problem(0, 0), Problem(999, 999), Problem(5, 990), *task.sample(50)]:
        assert len(p.prompt(3)) == task.prompt_len == 9
        assert len(p.answer(3)) == task.answer_len == 5


def test_held_out_set_never_sampled() -> None:
    """Eval accuracy must measure generalisation, not memorised training problems."""
    task = AdditionTask(digits=1, seed=3, eval_size=40)
    held = set(task.eval_set)
    assert len(held) == len(task.eval_set) == 40
    samples = task.sample(3000)
    assert not held & set(samples)
    # 1-digit problems: 100 in all, 40 held out, so the sampler covers the other 60.
    assert len(set(samples)) == 60


def test_constructor_rejects_bad_sizes() -> None:
    """A held-out set that eats the problem space would make sample() spin forever."""
    with pytest.raises(ValueError, match=r"task\.digits=0"):
        AdditionTask(digits=0)
    with pytest.raises(ValueError, match=r"task\.eval_size=50"):
        AdditionTask(digits=1, eval_size=50)


def test_reward_exact_answer_then_eos() -> None:
    """Reward 1 only for the exact zero-padded sum followed by EOS."""
    task = AdditionTask(digits=2, seed=0, eval_size=8)
    p = Problem(7, 35)
    assert task.reward(p, [*encode("042"), EOS]) == 1.0
    # Generation stops at EOS: tokens after it do not matter.
    assert task.reward(p, [*encode("042"), EOS, *encode("7"), PAD]) == 1.0
    assert task.reward(p, encode("042")) == 0.0  # no EOS
    assert task.reward(p, [*encode("0421"), EOS]) == 0.0  # EOS too late
    assert task.reward(p, [*encode("42"), EOS]) == 0.0  # not zero padded
    assert task.reward(p, [*encode("043"), EOS]) == 0.0  # wrong sum
    assert task.reward(p, []) == 0.0


def test_sft_batch_mask_covers_exactly_answer_predictions() -> None:
    """loss_mask[:, t] weights the prediction of token t+1: 1 iff that is an answer token."""
    task = AdditionTask(digits=2, seed=0, eval_size=8)
    problems = [Problem(7, 35), Problem(99, 99), Problem(0, 0)]
    batch = task.sft_batch(problems)
    tokens, mask = batch.tokens, batch.loss_mask
    seq = task.prompt_len + task.answer_len
    assert tokens.shape == mask.shape == (3, seq)
    assert tokens.dtype == torch.long
    assert mask.dtype.is_floating_point

    for row, p in enumerate(problems):
        assert tokens[row].tolist() == p.prompt(2) + p.answer(2)
        for t in range(seq):
            predicts_answer = t + 1 >= task.prompt_len and t + 1 < seq
            assert mask[row, t].item() == float(predicts_answer), (row, t)
        targets = tokens[row, 1:][mask[row, :-1].bool()].tolist()
        assert targets == p.answer(2)
        assert targets[-1] == EOS
    assert mask.sum().item() == 3 * task.answer_len


def test_same_seed_same_task() -> None:
    """Runs must be reproducible: the seed fixes both the eval set and the sample stream."""
    a, b = AdditionTask(2, seed=7, eval_size=32), AdditionTask(2, seed=7, eval_size=32)
    assert a.eval_set == b.eval_set
    assert a.sample(64) == b.sample(64)
    assert a.sample(64) == b.sample(64)
    c = AdditionTask(2, seed=8, eval_size=32)
    assert c.eval_set != a.eval_set


def test_reward_executor_text_scoring_equals_the_task_reward():
    """The RL loop scores responses as text in the reward ranks (exact scorer); that must
    be the task's own token-level reward for every kind of response."""
    import random

    from rl.tasks.kinds.arithmetic import EOS
    from rl.tasks.scoring import exact

    task = AdditionTask(digits=2, seed=0, eval_size=16)
    rng = random.Random(0)
    p = task.sample(1)[0]
    right = p.answer(2)
    cases = [right, right[:-1], [*right[:-1], 5], [*right, 7], [EOS], [*right[:2], EOS]]
    cases += [[rng.randrange(3, 13) for _ in range(4)] for _ in range(50)]
    cases += [[*right[:3], rng.randrange(0, 15)] for _ in range(20)]
    for ids in cases:
        text = exact("", task.response_text(ids), task.answer_text(p), {})
        assert text == task.reward(p, ids), ids
    assert task.reward(p, right) == 1.0


@pytest.mark.parametrize("drawn", [0, 1, 37])
def test_a_stream_resumed_from_its_position_continues_the_same_sequence(drawn) -> None:
    """A resumed job continues the prompt sequence its lost attempt drew from: a stream
    built from the saved position yields exactly what the original would have yielded."""
    from rl.tasks.common import TaskError, take
    from rl.tasks.kinds.arithmetic import ArithmeticTask

    task = ArithmeticTask(2, seed=3, eval_size=16)
    whole = [e.uid for e in take(task.train_stream(), drawn + 20)]
    original = task.train_stream()
    take(original, drawn)
    pos = json.loads(json.dumps(original.position()))  # as saved on disk
    assert pos["drawn"] == drawn
    resumed = ArithmeticTask(2, seed=3, eval_size=16).train_stream(pos)
    assert [e.uid for e in take(resumed, 20)] == whole[drawn:]
    assert [e.uid for e in take(original, 20)] == whole[drawn:]
    with pytest.raises(TaskError, match="saved prompt stream has seed=3 but this task has 4"):
        ArithmeticTask(2, seed=4, eval_size=16).train_stream(pos)
    with pytest.raises(TaskError, match="drawn=-1 is not a count"):
        task.train_stream({**pos, "drawn": -1})
