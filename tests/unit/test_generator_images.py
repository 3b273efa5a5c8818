"""The generator client's side of prompts with images, against a fake SGLang: each prompt's
images go with every request of its rollout (data URIs, whatever the reference), the
banned vision tokens as a logit bias, and a reply whose prompt token count is not the
controller's expansion fails the client in one line naming both counts."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from rl.config.sampling import BANNED, SamplingParams
from rl.generator import client as gc
from rl.generator.types import ModelLimits
from rl.serving import server_api as api
from rl.serving.launcher import ServerError

PNG = b"\x89PNG\r\n\x1a\nfake"


class _SGLang(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict]] = []
    extra_prompt_tokens: ClassVar[int] = 0  # what the fake's own expansion adds

    def do_GET(self) -> None:
        self._answer({"weight_version": "0"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        ids, sp = body["input_ids"], body["sampling_params"]
        new = [ids[-1] + 1 + i for i in range(sp["max_new_tokens"])]
        meta = {"finish_reason": {"type": "length"}, "weight_version": "0",
                "output_token_logprobs": [[-0.5, t, None] for t in new],
                "prompt_tokens": len(ids) + self.extra_prompt_tokens}  # fmt: skip
        self._answer({"output_ids": new, "meta_info": meta})

    def _answer(self, reply: object) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps(reply).encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def client() -> Iterator[gc.GeneratorClient]:
    _SGLang.bodies, _SGLang.extra_prompt_tokens = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SGLang)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with gc.GeneratorClient([url], ModelLimits(99, 128, (2,)), keys=api.ServerKeys.random()) as c:
        yield c
    server.shutdown()
    server.server_close()


def test_images_go_with_every_segment_and_vision_tokens_are_banned(client, tmp_path) -> None:
    img = tmp_path / "a.png"
    img.write_bytes(PNG)
    sampling = SamplingParams(max_new_tokens=4, banned_ids=(60, 61))
    (r,) = client.generate([[5, 61, 61, 7]], sampling, segment_tokens=2,
                           images=[(str(img),)])  # fmt: skip
    assert r.output_ids == [8, 9, 10, 11] and r.segments == 2 and r.images == (str(img),)
    uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert [b["image_data"] for b in _SGLang.bodies] == [[uri], [uri]]  # each segment's request
    assert [b["input_ids"] for b in _SGLang.bodies] == [[5, 61, 61, 7], [5, 61, 61, 7, 8, 9]]
    for b in _SGLang.bodies:
        assert b["sampling_params"]["logit_bias"] == {"60": BANNED, "61": BANNED}
    (plain,) = client.generate([[5, 6]], SamplingParams(max_new_tokens=1))
    assert "image_data" not in _SGLang.bodies[-1] and plain.images == ()


def test_a_server_that_expands_images_otherwise_fails_the_client(client) -> None:
    _SGLang.extra_prompt_tokens = 3
    (f,) = client.submit([5, 61, 7], SamplingParams(max_new_tokens=1), images=("data:,x",))
    with pytest.raises(ServerError, match=r"make 6 prompt tokens on the server, 3 with"):
        f.result(timeout=10)
    # Every later request fails with it too: the job stops rather than train on rows
    # whose images the trainer would place elsewhere.
    (g,) = client.submit([5, 6], SamplingParams(max_new_tokens=1))
    with pytest.raises(ServerError, match="processor disagrees"):
        g.result(timeout=10)


def test_a_request_sends_one_pad_per_image_and_the_server_expands_it(client) -> None:
    """SGLang's Qwen3-VL processor fails on pads sent already expanded: each image's run of
    pads goes as one, in every segment, and the reply's count is checked against ours."""
    client.limits = replace(client.limits, image_token_id=61)
    _SGLang.extra_prompt_tokens = 2  # the fake expands the one pad back to three
    sampling = SamplingParams(max_new_tokens=4)
    (r,) = client.generate([[5, 60, 61, 61, 61, 62, 7]], sampling, segment_tokens=2,
                           images=[("data:,x",)])  # fmt: skip
    assert [b["input_ids"] for b in _SGLang.bodies] == [
        [5, 60, 61, 62, 7],
        [5, 60, 61, 62, 7, 8, 9],
    ]
    assert r.prompt_ids == [5, 60, 61, 61, 61, 62, 7] and r.output_ids == [8, 9, 10, 11]
