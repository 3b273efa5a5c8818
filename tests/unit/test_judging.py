"""The judge's text side (prompt templates, verdict parsers) and its config's checks."""

from __future__ import annotations

import pytest

from rl.checks import check
from rl.config import ConfigError
from rl.tasks import judging
from tests.helpers.configs import composed


def test_the_prompt_is_filled_in_one_pass_and_shows_a_conversation():
    t = judging.prompt_template("correctness")
    out = judging.render(t, "Q?", "my {label} answer", 42, {})
    assert "my {label} answer" in out and "42" in out and "{prompt}" not in out
    conv = judging.render("{conversation}", "Q?", "A", None, {"messages": [
        {"role": "user", "content": "Q?"}, {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "A"}]})  # fmt: skip
    assert conv == "user: Q?\ntool: 7\nassistant: A"
    assert judging.render("{conversation}", "Q?", "A", None, {}) == "user: Q?\nassistant: A"


def test_verdicts_are_parsed_or_refused_never_guessed():
    assert judging.yes_no(" Yes, it is.") == 1.0 and judging.yes_no("no") == 0.0
    assert judging.score10("Score: 7/10") == 0.7 and judging.score10("10") == 1.0
    for parse, text in ((judging.yes_no, "maybe yes"), (judging.score10, "eleven"),
                        (judging.score10, "12"), (judging.score10, "7.5")):  # fmt: skip
        with pytest.raises(judging.VerdictError):
            parse(text)


def test_a_bad_judge_config_fails_in_one_line_before_launch(tmp_path):
    def err(*overrides: str) -> str:
        with pytest.raises(ConfigError) as e:
            check(composed(list(overrides)))
        assert "\n" not in str(e.value)
        return str(e.value)

    model = tmp_path / "judge"
    model.mkdir()
    assert err("reward.fn=judge") == (
        "reward.fn=judge needs reward.judge.model_path (an HF directory of the judge model)"
    )
    missing = tmp_path / "nope"
    assert err("reward.fn=judge", f"reward.judge.model_path={missing}") == (
        f"reward.judge.model_path={str(missing)!r} is not a directory"
    )
    assert "has no config.json" in err("reward.fn=judge", f"reward.judge.model_path={model}")
    (model / "config.json").write_text("{}")
    assert "has no tokenizer" in err("reward.fn=judge", f"reward.judge.model_path={model}")
    (model / "tokenizer.json").write_text("{}")
    base = ["reward.fn=judge", f"reward.judge.model_path={model}", "sft.eval_every=0",
            "sft.stop_at_accuracy=null"]  # fmt: skip
    got = err(*base, "reward.judge.prompt=nope")
    assert "reward.judge.prompt='nope': not one of ['correctness']" in got
    no_response = tmp_path / "p.txt"
    no_response.write_text("Grade {prompt}")
    assert "neither {response} nor {conversation}" in err(
        *base, f"reward.judge.prompt={no_response}"
    )
    assert "reward.judge.parser 'vibes': not a built-in" in err(*base, "reward.judge.parser=vibes")
    assert err(*base, "reward.judge.servers=0") == "reward.judge.servers=0 must be >= 1"
    assert "the judge scores on the reward ranks only" in err(*base[:2], "sft.eval_every=5")
    assert "set reward.fn=judge" in err(f"reward.judge.model_path={model}")
    check(composed(base))  # all good
