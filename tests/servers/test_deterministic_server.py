"""A deterministic run's CPU server (``ServerConfig.batch_invariant``): a request's tokens and
log-probs, bit for bit, do not depend on what the server computed before it.

A resumed segment's prefix (its prompt and the tokens it has) was seen by the server before: its
prompt in a sibling sample's prefill, its tokens in its own earlier decoding. Taken from
SGLang's radix cache, that KV came from another forward than the request's own prefill
and moved its log-probs by 4.8e-7 (a deterministic 20-step run parted at one group so);
with every prefix computed by the request itself (rl/serving/launcher.py,
``CPU_DETERMINISTIC_ARGS``) each case below equals the request sent to a fresh server.
"""

from __future__ import annotations

import pytest

from rl.serving import server_api as api
from rl.serving.launcher import ServerConfig, ServerLauncher
from tests.helpers.hf_models import make_model

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("det")
    cfg = ServerConfig(model_path=str(make_model("llama", d / "tiny")), batch_invariant=True,
                       threads=1)  # fmt: skip
    with ServerLauncher(cfg, n=1, log_dir=d / "logs") as launcher:
        yield launcher
        launcher.stop(grace=0)


def _greedy(launcher, prompts: list[list[int]], n: int = 3) -> list[tuple[list, list]]:
    body = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    out = api.call(launcher.urls[0], api.generate(prompts, [body] * len(prompts)), launcher.keys)
    out = out if isinstance(out, list) else [out]  # one prompt: one object
    pairs = [o["meta_info"]["output_token_logprobs"] for o in out]
    return [([t for _, t, *_ in p], [lp for lp, *_ in p]) for p in pairs]


def test_a_segments_log_probs_do_not_depend_on_what_the_server_saw_before(server):
    flush = lambda: api.call(server.urls[0], api.flush_cache(), server.keys)  # noqa: E731
    flush()
    ids, _ = _greedy(server, [PROMPT], n=6)[0]
    segment = PROMPT + ids[:3]  # a sample cut after 3 tokens, resumed
    flush()
    (alone,) = _greedy(server, [segment])
    seen_before = {  # what ran on the server before the segment came
        "a longer sibling's prefill": [[*PROMPT, 20, 21, 22, 23, 24, 25, 26]],
        "its own first segment, decoded": [PROMPT],
        "itself": [segment],
    }
    for what, before in seen_before.items():
        flush()
        _greedy(server, before)
        assert _greedy(server, [segment])[0] == alone, what
    flush()
    with_sibling = _greedy(server, [segment, [*PROMPT, 30, 31, 32, 33, 34]])[0]
    assert with_sibling == alone, "batched with a sibling"
