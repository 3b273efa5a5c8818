"""Multi-turn episodes over token ids: tool-call parsing, tools, the chat template's
observation tokens and the episode's trajectory, token by token."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from rl.config.sampling import SamplingParams
from rl.controller.episodes import EpisodeDriver
from rl.envs.chat import ChatError, ChatRenderer, template_text
from rl.envs.environment import EnvSpecError, ToolEnvironment, load_environment
from rl.envs.toolcall import ToolCall, parse
from rl.envs.tools import Tool, ToolError, calculate, load_tool, load_tools, run_tool
from rl.generator.types import Rollout
from rl.tasks.common import Example
from tests.helpers.tool_model import chatml_tokenizer


# ---------------------------------------------------------------------- tool-call formats
def test_qwen_format_parses_every_call_and_reports_bad_ones():
    text = (
        'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
        '</tool_call>\n<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}'
        "</tool_call><tool_call>{oops}</tool_call><tool_call>[1]</tool_call>"
    )
    calls = parse("qwen", text)
    assert calls[0] == ToolCall("calculator", {"expression": "2+3"})
    assert calls[1] == ToolCall("python", {"code": "1"})  # arguments given as a JSON string
    assert calls[2].error.startswith("tool call 3: not JSON")
    assert calls[3].error == "tool call 4: expected a JSON object, got list"
    assert parse("qwen", "The answer is 5.") == []


def test_llama3_format_parses_json_calls_and_leaves_prose_alone():
    one = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1;2"}}'
    assert parse("llama3", one) == [ToolCall("calculator", {"expression": "1;2"})]
    two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert [c.name for c in parse("llama3", two)] == ["a", "b"]
    assert parse("llama3", "It is 42.") == []
    assert parse("llama3", '{"parameters": {}}')[0].error == "tool call 1: no tool name"
    with pytest.raises(KeyError, match=r"env\.tool_format='hermes2'"):
        parse("hermes2", "")


# ---------------------------------------------------------------------- tools
@pytest.mark.parametrize(
    "expression, want",
    [
        ("(12 + 7) * 3", "57"),
        ("7 / 2", "3.5"),
        ("2 ** 10 - 1", "1023"),
        ("-3 // 2", "-2"),
        ("1 / 0", "error: division by zero"),
        ("__import__('os')", "error: \"__import__('os')\" is not arithmetic"),
        ("9 ** 99", "error: an exponent must be a whole number from -64 to 64"),
        ("2 +", "error: invalid syntax"),
    ],
)
def test_calculator_is_exact_and_never_evaluates_code(expression, want):
    assert calculate(expression) == want


def _bad_schema_tool(x):  # no type hint, no description: no schema
    """Nothing."""


BAD = Tool("bad", "d", {"type": "object", "properties": {"x": {"type": 7}}}, lambda x: x)


def test_tools_load_by_name_or_path_and_bad_ones_fail_in_one_line(tmp_path: Path):
    user = tmp_path / "my_tools.py"
    user.write_text(
        "def lookup(key: str) -> str:\n"
        '    """Look a key up.\n\n    Args:\n        key: The key.\n    """\n'
        "    return key.upper()\n"
    )
    tools = load_tools(["calculator", f"{user}:lookup"])
    assert sorted(tools) == ["calculator", "lookup"]
    assert tools["lookup"].parameters["properties"]["key"]["type"] == "string"
    # Its calls run in worker processes loaded from the spec (tests/multiproc/test_tool_workers.py).
    assert tools["lookup"].spec == f"{user}:lookup" and tools["calculator"].spec is None
    with pytest.raises(ToolError, match="tool 'grep': unknown"):
        load_tool("grep")
    with pytest.raises(ToolError, match="tool 'bad': parameters are not valid JSON Schema"):
        load_tool(f"{Path(__file__)}:BAD")
    with pytest.raises(ToolError, match=r"^tool '.*none\.py:f': no such file"):
        load_tool(f"{tmp_path / 'none.py'}:f")
    with pytest.raises(ToolError, match="no schema from its signature and docstring"):
        load_tool(f"{Path(__file__)}:_bad_schema_tool")
    with pytest.raises(ToolError, match="'calculator' is given twice"):
        load_tools(["calculator", "calculator"])


def test_a_failing_call_is_an_observation_never_an_exception():
    def boom(x: str) -> str:
        raise RuntimeError("disk on fire")

    tools = {
        "calculator": load_tool("calculator"),
        "boom": Tool("boom", "d", {"type": "object", "properties": {}}, boom),
    }
    cases = [
        (ToolCall("nope", {}), "error: no tool 'nope'; tools: ['boom', 'calculator']"),
        (
            ToolCall("calculator", {"expr": "1"}),
            "error: bad arguments for 'calculator': 'expression' is a required property",
        ),
        (ToolCall("boom", {"x": "1"}), "error: 'boom' raised RuntimeError: disk on fire"),
        (ToolCall("", {}, "tool call 1: no tool name"), "error: tool call 1: no tool name"),
    ]
    for call, text in cases:
        out = run_tool(tools, call)
        assert (out.text, out.status) == (text, "error")


# ---------------------------------------------------------------------- chat tokens
@pytest.fixture(scope="module")
def chatml() -> object:
    """A byte-level BPE tokenizer with ChatML's special tokens, trained in milliseconds."""
    corpus = ['{"name": "calculator", "arguments": {"expression": "12 * 7"}}'] * 20
    corpus += ["<tool_call> </tool_call> <tool_response> system user assistant tools"] * 20
    return chatml_tokenizer(corpus)


CALC = load_tool("calculator")
ROW = {
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12*7?"}]
}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>'


def _driver(tok, env=None, max_turns: int = 4) -> EpisodeDriver:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = ChatRenderer(tok, end, [CALC.schema()])
    return EpisodeDriver(env or ToolEnvironment({"calculator": CALC}, "qwen"), chat, max_turns)


def _start(tok, driver: EpisodeDriver, max_new: int = 256) -> tuple[Example, Rollout]:
    prompt = driver.chat.prompt_ids(ROW["messages"])
    item = Example("q", tuple(prompt), "", messages=tuple(ROW["messages"]))
    return item, Rollout(prompt, SamplingParams(max_new_tokens=max_new))


def _turn(tok, r: Rollout, text: str, versions=lambda i: 0, room: int | None = None) -> None:
    """One turn as a server would return it: ``text``'s tokens and the end token (cut to
    ``room`` tokens), log-probs -0.5, -0.51, ..."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = (tok(text, add_special_tokens=False)["input_ids"] + [end])[: room or r.remaining]
    lp = [-0.5 - 0.01 * i for i in range(len(ids))]
    r.append(ids, lp, [versions(i) for i in range(len(ids))], "stop" if ids[-1] == end else None)


def _answer(driver: EpisodeDriver, item: Example, r: Rollout) -> bool:
    """The environment's answer applied; True when the next turn is due."""
    return driver.awaiting(r) and driver.apply(r, driver.answer(item, r).result())


def test_the_trajectory_is_the_templates_rendering_with_mask_and_versions_per_token(chatml):
    driver = _driver(chatml)
    item, r = _start(chatml, driver)
    _turn(chatml, r, CALL, lambda i: 3 if i < 4 else 4)  # the turn spans a weight update
    n0 = len(r.output_ids)
    assert _answer(driver, item, r)
    ((start, obs),) = r.observed
    _turn(chatml, r, "It is 84.", lambda i: 5)
    assert not _answer(driver, item, r) and r.finish_reason == "stop"
    ep = r.episode
    assert ep["stop"] == "answer" and ep["turns"] == 2
    assert ep["messages"][-2] == {"role": "tool", "name": "calculator", "content": "84"}
    # The ids equal the template's rendering of the final conversation (less the newline
    # the template writes after the last turn's end token, which the model never sampled).
    full = chatml.apply_chat_template(ep["messages"], tools=[CALC.schema()], tokenize=False)
    want = chatml(full.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    assert r.prompt_ids + r.output_ids == want
    # Token by token: which are trained, their log-probs and versions (an observation
    # carries the version of the turn it answers).
    n1 = len(r.output_ids) - n0 - obs
    assert start == n0 and r.sampled() == [True] * n0 + [False] * obs + [True] * n1
    assert r.versions == [3] * 4 + [4] * (n0 - 4) + [4] * obs + [5] * n1
    assert r.logprobs[n0 : n0 + obs] == [0.0] * obs and r.logprobs[:2] == [-0.5, -0.51]
    observed = chatml.decode(r.output_ids[n0 : n0 + obs])
    assert observed == "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    assert ep["metrics"] == {"tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0}


def test_a_saved_episode_resumes_at_its_last_turn_and_regenerates_nothing(chatml):
    driver = _driver(chatml)
    item, r = _start(chatml, driver)
    _turn(chatml, r, CALL)
    saved = json.loads(json.dumps(asdict(r)))  # as the rollout-state file keeps it
    resumed = Rollout(**{**saved, "sampling": r.sampling})
    assert driver.awaiting(resumed)  # the environment is asked again, nothing regenerated
    assert _answer(driver, item, resumed)
    ids, _, _ = resumed.next_request(None)
    assert ids[: len(r.prompt_ids) + len(r.output_ids)] == r.prompt_ids + r.output_ids
    _turn(chatml, resumed, "It is 84.")
    assert not _answer(driver, item, resumed) and resumed.episode["stop"] == "answer"


def test_limits_end_an_episode_and_say_which(chatml):
    driver = _driver(chatml, max_turns=3)
    item, r = _start(chatml, driver)
    for _ in range(2):
        _turn(chatml, r, CALL)
        assert _answer(driver, item, r)
    _turn(chatml, r, CALL)
    assert not _answer(driver, item, r)
    assert (r.episode["stop"], r.episode["turns"], r.finish_reason) == ("max_turns", 3, "stop")
    # The token budget: an observation that does not fit ends the episode as cut.
    driver = _driver(chatml)
    item, r = _start(chatml, driver, max_new=40)
    _turn(chatml, r, CALL)
    assert not _answer(driver, item, r)
    assert (r.episode["stop"], r.finish_reason, r.observed) == ("max_tokens", "length", [])
    # A turn cut by the budget (no end token) is not the environment's to answer.
    item, r = _start(chatml, driver, max_new=5)
    _turn(chatml, r, CALL)
    assert r.finish_reason == "length" and not driver.awaiting(r) and r.episode is None


def test_a_template_without_tools_or_that_rewrites_history_is_refused(chatml):
    end = chatml.convert_tokens_to_ids("<|im_end|>")
    plain = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(ChatError, match=r"does not render tools.*env\.chat_template=chatml_tools"):
        ChatRenderer(chatml, end, [CALC.schema()], template=plain)
    forgetful = "{{ messages[-1].content }}<|im_end|>{% if add_generation_prompt %}A{% endif %}"
    chat = ChatRenderer(chatml, end, template=forgetful)
    with pytest.raises(ChatError, match="renders earlier turns differently"):
        chat.observation_ids(
            [{"role": "assistant", "content": "x"}], [{"role": "tool", "content": "y"}]
        )
    with pytest.raises(ChatError, match=r"env\.chat_template='nope': not one of"):
        template_text("nope")


class EchoEnv:
    """A user's environment: every turn is answered with its own text, twice."""

    def __init__(self, tools, tool_format):
        self.tools = list(tools.values())

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        from rl.envs.environment import Step

        if len(messages) >= 5:
            return Step(done=True, reward=1.0)
        return Step(({"role": "tool", "content": messages[-1]["content"]},))


class NoSteps:
    def __init__(self, tools, tool_format):
        pass


def test_a_users_environment_is_loaded_by_path_and_bad_ones_fail_in_one_line(tmp_path):
    tools = {"calculator": CALC}
    assert isinstance(load_environment(None, tools, "qwen"), ToolEnvironment)
    env = load_environment(f"{Path(__file__)}:EchoEnv", tools, "qwen")
    assert env.tools == [CALC] and env.reset({"prompt": "hi"})[0]["content"] == "hi"
    with pytest.raises(EnvSpecError, match=r"^env\.cls '.*:Nope': .* has no attribute 'Nope'"):
        load_environment(f"{Path(__file__)}:Nope", tools, "qwen")
    with pytest.raises(EnvSpecError, match=r"TypeError building it with \(tools, tool_format\)"):
        load_environment(f"{Path(__file__)}:_bad_schema_tool", tools, "qwen")
    with pytest.raises(EnvSpecError, match="has no reset or step method"):
        load_environment(f"{Path(__file__)}:NoSteps", tools, "qwen")


# ---------------------------------------------------------------------- the env config
def _check(*overrides: str) -> str:
    """The one line ``rl.checks.check`` fails with."""
    from rl.checks import check
    from rl.config import ConfigError
    from tests.helpers.configs import composed

    with pytest.raises(ConfigError) as e:
        check(composed(["task=dataset", *overrides]))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_env_config_fails_in_one_line_before_launch(tmp_path):
    assert "env.tools: tool 'grep': unknown" in _check("env.tools=[calculator,grep]")
    bad = f"env.tools=[{Path(__file__)}:BAD]"
    assert "tool 'bad': parameters are not valid JSON Schema" in _check(bad)
    assert "env.max_turns=0 must be >= 1" in _check("env.tools=[calculator]", "env.max_turns=0")
    got = _check("env.tools=[calculator]", "env.tool_format=xml")
    assert got == "env.tool_format='xml' must be one of llama3, qwen"
    assert "env.cls '" in _check(f"env.cls={Path(__file__)}:NoSteps")
    assert "rl.deterministic=true with env.tools" in _check(
        "env.tools=[calculator]", "rl.deterministic=true"
    )
    assert "task=arithmetic has no chat template" in _check(
        "task=arithmetic", "env.tools=[calculator]"
    )
    assert "the warm-up's greedy decoder plays no episodes" in _check(
        "env.tools=[calculator]", "sft.steps=5", "sft.eval_every=5"
    )


def test_a_tokenizer_template_without_tools_is_refused_when_the_task_is_built(chatml, tmp_path):
    from rl.config import ConfigError
    from rl.tasks import sft_batch
    from rl.tasks.checks import check_task
    from tests.helpers.configs import composed

    chatml.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    chatml.save_pretrained(tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    demo = [{"role": "assistant", "content": CALL},
            {"role": "tool", "name": "calculator", "content": "84"},
            {"role": "assistant", "content": "84"}]  # fmt: skip
    data.write_text(json.dumps({"prompt": "12*7?", "label": "84", "demo": demo}) + "\n")
    base = ["task=dataset", f"task.tokenizer={tmp_path / 'tok'}", f"task.train_files=[{data}]",
            f"task.eval_files=[{data}]", "env.tools=[calculator]", "rl.steps=0"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"^the chat template does not render tools .*chatml_"):
        check_task(composed(base))
    task = check_task(composed([*base, "env.chat_template=chatml_tools", "task.demo_key=demo"]))
    (ex,) = task.eval_sets["eval"]
    assert ex.messages == ({"role": "user", "content": "12*7?"},)
    assert '"name": "calculator"' in ex.prompt_text  # the tools are in the prompt
    # The warm-up's target: the demonstration as an episode holds it (the template's
    # tokens, less the newline after the last end token), trained on but the tool's result.
    full = chatml.apply_chat_template([*ex.messages, *demo], tools=[CALC.schema()],
                                      chat_template=template_text("chatml_tools"),
                                      tokenize=False)  # fmt: skip
    want = chatml(full.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    assert list(ex.prompt_ids + ex.target_ids) == want
    observed = [t for t, m in zip(ex.target_ids, ex.target_mask, strict=True) if not m]
    assert chatml.decode(observed).startswith("\n<|im_start|>user\n<tool_response>\n84\n")
    assert ex.target_mask.count(False) == len(observed) > 0
    batch = sft_batch([ex], pad_id=0)
    p = len(ex.prompt_ids)
    n = len(ex.target_ids)
    assert batch.loss_mask[0, p - 1 : p - 1 + n].tolist() == [float(m) for m in ex.target_mask]
    bad = json.dumps({"prompt": "q", "label": "1", "demo": [{"role": "tool", "content": "1"}]})
    data.write_text(bad + "\n")
    with pytest.raises(ConfigError, match=r"line 1: 'demo' \(task.demo_key\): a demonstration "
                       "must end with an assistant turn"):  # fmt: skip
        check_task(composed([*base, "env.chat_template=chatml_tools", "task.demo_key=demo"]))


def test_a_tool_that_overruns_its_time_is_answered_as_a_timeout():
    import time

    from rl.envs.sandbox import Limits

    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    schema = {"type": "object", "properties": {"seconds": {"type": "number"}}}
    tools = {"slow": Tool("slow", "d", schema, slow, limits=Limits(wall_s=0.2))}
    assert run_tool(tools, ToolCall("slow", {"seconds": 0.01})).text == "done"
    t = time.monotonic()
    out = run_tool(tools, ToolCall("slow", {"seconds": 30}))
    assert (out.status, out.text) == ("timeout", "error: 'slow' took longer than 0.2 s")
    assert time.monotonic() - t < 3


def test_the_env_reward_is_the_environments_and_a_missing_one_fails():
    from rl.tasks.scoring import RewardValueError, env

    assert env("p", "r", None, {"env_reward": 0.5}) == 0.5
    with pytest.raises(RewardValueError, match="ended by 'max_turns'"):
        env("p", "r", None, {"env_reward": None, "env_stop": "max_turns"})


def test_episode_metrics_per_trajectory():
    from rl.controller.episodes import episode_metrics

    def sample(turns, calls, errors, observed, out_len, stop):
        r = Rollout([1], SamplingParams(max_new_tokens=64))
        r.output_ids = [5] * out_len
        r.observed = [[0, n] for n in observed]
        r.episode = {"turns": turns, "stop": stop,
                     "metrics": {"tool_calls": calls, "tool_errors": errors}}  # fmt: skip
        return r

    plain = Rollout([1], SamplingParams())  # a one-turn sample: not counted
    two, three = sample(2, 1, 0, [6], 20, "answer"), sample(3, 2, 1, [4, 4], 30, "max_turns")
    m = episode_metrics([two, three, plain])
    assert m["episode_turns_mean"] == 2.5 and m["episode_tool_calls_mean"] == 1.5
    assert m["episode_tool_success"] == 2 / 3 and m["episode_observation_tokens_mean"] == 7
    assert m["episode_turn_len_mean"] == (14 + 22) / 5
    assert m["episode_stop_answer_frac"] == 0.5 == m["episode_stop_max_turns_frac"]
    assert episode_metrics([plain]) == {}
