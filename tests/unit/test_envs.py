"""Multi-turn episodes over token ids: tool-call parsing, tools, the chat template's
observation tokens and the episode's trajectory, token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.envs.chat import ChatError, ChatRenderer, template_text
from rl.envs.environment import EnvSpecError, ToolEnvironment, load_environment
from rl.envs.episode import Episode, EpisodeLimits, Generated, Trajectory, run_episode
from rl.envs.toolcall import ToolCall, parse
from rl.envs.tools import Tool, ToolError, calculate, load_tool, load_tools, run_tool


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
    assert run_tool(tools, ToolCall("lookup", {"key": "ab"})).text == "AB"
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
def chatml(tmp_path_factory) -> object:
    """A byte-level BPE tokenizer with ChatML's special tokens, trained in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ['{"name": "calculator", "arguments": {"expression": "12 * 7"}}'] * 20
    corpus += ["<tool_call> </tool_call> <tool_response> system user assistant tools"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = template_text("chatml_tools")
    return fast


CALC = load_tool("calculator")
ROW = {
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12*7?"}]
}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>'


def _episode(tok, env=None, limits: EpisodeLimits | None = None) -> Episode:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = ChatRenderer(tok, end, [CALC.schema()])
    env = env or ToolEnvironment({"calculator": CALC}, "qwen")
    return Episode.start(env, chat, tok.decode, limits or EpisodeLimits(), ROW)


def _scripted(tok, replies: list[str], version_of_turn):
    """A generator that answers with fixed texts, tokenized as the model would sample them."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = iter(replies)

    def generate(ids: list[int], room: int) -> Generated:
        out = (tok(next(turns), add_special_tokens=False)["input_ids"] + [end])[:room]
        turn = generate.turn = getattr(generate, "turn", -1) + 1
        lp = [-0.5 - 0.01 * i for i in range(len(out))]
        return Generated(out, lp, [version_of_turn(turn, i) for i in range(len(out))])

    return generate


def test_the_trajectory_is_the_templates_rendering_with_mask_and_versions_per_token(chatml):
    ep = _episode(chatml)
    # Turn 0's tokens span a weight update (versions 3 then 4); turn 1 runs under 5.
    gen = _scripted(chatml, [CALL, "It is 84."], lambda t, i: 5 if t else (3 if i < 4 else 4))
    traj = run_episode(ep, gen)
    assert traj.stop == "answer" and len(traj.turns) == 2
    assert traj.messages[-2] == {"role": "tool", "name": "calculator", "content": "84"}
    # The ids equal the template's rendering of the final conversation (less the newline
    # the template writes after the last turn's end token, which the model never sampled).
    full = chatml.apply_chat_template(traj.messages, tools=[CALC.schema()], tokenize=False)
    want = chatml(full.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    assert traj.prompt_ids + traj.ids == want
    # Token by token: which are trained, their log-probs and versions.
    n0, n1 = traj.turns[0].response_tokens, traj.turns[1].response_tokens
    obs = traj.turns[0].observation_tokens
    assert traj.trained == [True] * n0 + [False] * obs + [True] * n1
    assert traj.versions == [3] * 4 + [4] * (n0 - 4) + [-1] * obs + [5] * n1
    assert traj.logprobs[n0 : n0 + obs] == [0.0] * obs
    assert traj.logprobs[:2] == [-0.5, -0.51]
    observed = chatml.decode(traj.ids[n0 : n0 + obs])
    assert observed == "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    assert traj.turns[0].metrics == {"tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0}


def test_a_saved_episode_resumes_at_its_last_turn_and_regenerates_nothing(chatml):
    ep = _episode(chatml)
    gen = _scripted(chatml, [CALL, "It is 84."], lambda t, i: t)
    ep.record(gen(*ep.request()))
    saved = json.loads(json.dumps(ep.traj.to_json()))
    resumed = Episode(ep.env, ep.chat, ep.decode, ep.limits, Trajectory.from_json(saved))
    ids, _ = resumed.request()
    assert ids == ep.traj.prompt_ids + ep.traj.ids  # continues after the observation
    resumed.record(gen(ids, 64))
    assert resumed.traj.stop == "answer" and len(resumed.traj.turns) == 2


def test_limits_end_an_episode_and_say_which(chatml):
    loops = _scripted(chatml, [CALL] * 9, lambda t, i: 0)
    traj = run_episode(_episode(chatml, limits=EpisodeLimits(max_turns=3)), loops)
    assert (traj.stop, len(traj.turns)) == ("max_turns", 3)
    first = traj.turns[0].response_tokens + traj.turns[0].observation_tokens
    room = len(traj.prompt_ids) + first + 5  # the second turn is cut after 5 tokens
    ep = _episode(chatml, limits=EpisodeLimits(max_tokens=room))
    traj = run_episode(ep, _scripted(chatml, [CALL] * 9, lambda t, i: 0))
    assert traj.stop == "max_tokens" and len(traj.prompt_ids) + len(traj.ids) == room
    assert traj.turns[1].response_tokens == 5
    tight = _episode(chatml, limits=EpisodeLimits(max_tokens=room - 6))  # no room for obs
    traj = run_episode(tight, _scripted(chatml, [CALL] * 9, lambda t, i: 0))
    assert (
        traj.stop == "max_tokens" and len(traj.turns) == 1 and not traj.turns[0].observation_tokens
    )
    cut = _episode(chatml)
    cut.record(Generated([5, 6], [-1.0, -1.0], [0, 0]))  # no end token: cut by length
    assert cut.traj.stop == "length" and cut.request() is None


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
