"""The channels' closed control plane: schema-only decoding and HMAC, in this process.

Every message type the job's channels carry goes through the codec and back unchanged;
a pickle payload, tampered bytes, another key, another channel's message, a replay and a
header naming an undeclared type are all dropped and counted, and nothing they name runs.
Channels run over an in-memory ``HashStore`` (no server)."""

from __future__ import annotations

import ast
import dataclasses
import datetime as dt
import decimal
import json
import logging
import math
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rl.batch import TrainBatch
from rl.config.sampling import SamplingParams
from rl.generator import service as gen
from rl.generator.types import Rollout
from rl.reward import service as rew
from rl.runtime import channel as channel_mod
from rl.runtime import codec
from rl.runtime.channel import Channel, ChannelError, ChannelTimeout, Failed, RemoteError
from rl.tasks.common import Example
from rl.tasks.scoring import ScoreItem, ScoreResult
from rl.trainer import service as trn

KEY = bytes(range(32))
TENSORS = {
    "tokens": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    "loss_mask": torch.tensor([[0.0, 1.0], [1.0, 0.5]]),
    "bf16": torch.randn(2, 3).to(torch.bfloat16),
    "f16": torch.randn(5).to(torch.float16),
    "f64": torch.tensor([math.pi, -0.0, math.inf]),
    "mask": torch.tensor([True, False, True]),
    "i32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
    "u8": torch.tensor([0, 255], dtype=torch.uint8),
    "empty": torch.empty(0, 7),
    "empty_i64": torch.empty(4, 0, dtype=torch.int64),
    "scalar": torch.tensor(2.5),
    "strided": torch.arange(20.0).reshape(4, 5)[:, 1::2],  # a view: sent contiguous
}


@dataclass
class Examples:
    """A nested message (not on a channel today): the task's and the generator's own
    dataclasses, with Mapping[str, Any], tuple and Optional fields, nested twice."""

    examples: list[Example]
    best: Example | None
    rollouts: list[Rollout]


@dataclass
class Plain:
    """A message of plain values (``Any``), as reward labels and metadata are."""

    result: dict[str, Any] = field(default_factory=dict)


PLAIN = (Plain,)
EXAMPLE = Example(
    "f.jsonl line 3",
    (1, 2, 3),
    "2+2?",
    "4",
    metadata={"level": 2, "tags": ["a"]},
    target_ids=(7, 2),
)
ROLLOUT = Rollout(
    [1, 2],
    SamplingParams(0.7, stop_token_ids=(2,), seed=5),
    1,
    3,
    output_ids=[4, 5],
    logprobs=[-0.5, -1.25],
    versions=[2, 3],
)
# Every message type a channel carries (rl/{trainer,generator,reward}/service.py), with
# realistic values: a training batch, the warm-up's log, the trainer's answers, the
# generator's servers, reward requests with the labels and metadata dataset rows hold.
MESSAGES = [
    (trn.COMMANDS, trn.Train(7, TrainBatch(TENSORS["tokens"], TENSORS["strided"]))),
    (
        trn.COMMANDS,
        trn.Train(
            7, TrainBatch(TENSORS["tokens"], rewards=TENSORS["f64"], overlong=TENSORS["mask"])
        ),
    ),
    (PLAIN, Plain(dict(TENSORS))),  # every dtype a channel carries
    (trn.COMMANDS, trn.Connect(["http://10.0.0.1:30000", "http://10.0.0.2:30000"])),
    (trn.COMMANDS, trn.Join("10.0.0.9", [29500, 29501], [[0], [1]])),
    (trn.COMMANDS, trn.Join("10.0.0.9", [29502], [[1, 0, 2]])),
    (trn.COMMANDS, trn.Reserve(2)),
    (trn.COMMANDS, trn.Push(12)),
    (trn.COMMANDS, trn.Save("/out/ckpt/step_3", True, 3)),
    (trn.COMMANDS, trn.Stop()),
    (trn.REPLIES, trn.Log(4, {"loss": 0.25, "accuracy": 1.0, "nan": math.nan}, "sft", True)),
    (trn.REPLIES, trn.Ready(0.75, "/out/warmup")),
    (trn.REPLIES, trn.Ready(None, None)),
    (trn.REPLIES, trn.Trained({"loss": 1.5, "grad_norm": math.inf, "tokens": 4096.0})),
    (trn.REPLIES, trn.Rendezvous("10.0.0.3", [1, 2])),
    (trn.REPLIES, trn.Joined()),
    (trn.REPLIES, trn.Pushed(1.5e9, 1.6e9, [2])),
    (trn.REPLIES, trn.Saved("/x", None)),
    (trn.REPLIES, trn.Saved("/x", "/x/hf")),
    (PLAIN, Plain({"v": 1, "nested": [{"a": (1, "b")}, None], "raw": b"\x01"})),
    ((gen.Stop,), gen.Stop()),
    ((gen.Up, gen.Restarted), gen.Up(1, ["http://h:1", "http://h:2"], "/models/qwen")),
    (
        (gen.Up, gen.Restarted),
        gen.Restarted(1, 0, "http://h:1", "exited with code -9", seconds=41.5),
    ),
    ((gen.Up, gen.Down, gen.Restarted), gen.Down(1, 2, "http://h:3", "exited")),
    (
        (rew.Score, rew.Stop),
        rew.Score(
            3,
            [
                ScoreItem("What is 2+2?", "4", "4"),
                ScoreItem("p", "r\udcff é", 17, {"id": 3, "raw": b"\x00\xff", "ratio": 0.5}),
                ScoreItem(
                    "p",
                    "r",
                    {"answers": ["1", "one"], "pair": (1, "a"), 4: None},
                    {
                        "price": decimal.Decimal("12.50"),
                        "when": dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.UTC),
                        "day": dt.date(2024, 5, 1),
                        "at": dt.time(8, 15),
                        "took": dt.timedelta(days=1, seconds=3, microseconds=9),
                        "scores": torch.tensor([1, 2], dtype=torch.int64),
                    },
                ),
            ],
        ),
    ),
    ((rew.Score, rew.Stop), rew.Stop()),
    (
        (rew.Scored,),
        rew.Scored(3, [ScoreResult(1.0), ScoreResult(0.0, {"format_ok": 0.0}, True)], 1, 0),
    ),
    ((rew.Scored,), rew.Scored(4, [], 0, 2)),
    ((rew.Scored, rew.Wake), rew.Wake()),
    ((Examples,), Examples([EXAMPLE, Example("u", (), "", None)], EXAMPLE, [ROLLOUT])),
    ((Examples,), Examples([], None, [])),
]


def same(a: object, b: object) -> bool:
    """Equal, and of the same types all the way down (tensors: dtype, shape and bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


@pytest.mark.parametrize(("types", "msg"), MESSAGES, ids=lambda x: type(x).__name__)
def test_every_channel_message_makes_the_round_trip(types, msg):
    codec.check_types((*types, Failed))
    back = codec.decode(codec.encode(msg, types), types)
    assert same(back, msg), (back, msg)


def test_every_message_type_of_the_services_is_round_tripped_above():
    """A new message type fails here until it has an example in MESSAGES."""
    tried = {type(msg) for _, msg in MESSAGES}
    for module in (trn, gen, rew):
        defined = {
            v
            for v in vars(module).values()
            if dataclasses.is_dataclass(v) and isinstance(v, type)
            if v.__module__ == module.__name__
        }
        assert defined - tried == set(), f"{module.__name__}: no example of {defined - tried}"


def test_declared_types_are_checked_when_a_channel_is_made():
    @dataclass
    class Opaque:
        handle: object  # Any-like: fine

    @dataclass
    class Pathy:
        where: Path

    Channel(dist.HashStore(), "ok", (Opaque,), 1, key=KEY)
    with pytest.raises(ChannelError, match=r"Pathy.where: type .*Path.* cannot travel"):
        Channel(dist.HashStore(), "bad", (Pathy,), 1, key=KEY)
    with pytest.raises(ChannelError, match="key is missing"):
        Channel(dist.HashStore(), "nokey", (Opaque,), 1, key=b"")


# ------------------------------------------------------------------- decoding refuses
def _frame(header: object, blob: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return len(head).to_bytes(4, "big") + head + blob


def _tb(tokens: object) -> dict:
    """A TrainBatch's fields with ``tokens`` as given and every other one absent (None)."""
    rest = [f.name for f in dataclasses.fields(TrainBatch) if f.name != "tokens"]
    return {"tokens": tokens, **{name: [1, None] for name in rest}}


def _train(fields: dict, segs: list[int], blob: bytes = b"") -> bytes:
    return _frame({"type": "Train", "fields": {"images": [], **fields}, "segs": segs}, blob)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x00\x00", "too short"),
        (b"\x00\x00\x00\x09{}", "overruns"),
        (_frame([1, 2]), r"not \{type, fields, segs\}"),
        (_frame({"type": "os.system", "fields": {}, "segs": []}), "'os.system' is not one"),
        (_frame({"type": "Joined", "fields": {}, "segs": []}), "'Joined' is not one"),  # a reply
        (_train({"step": 1}, []), r"fields \['batch'\] do not match"),
        (_train({"step": 1, "batch": [], "extra": 1}, []), r"fields \['extra'\]"),
        (_train({"step": "1", "batch": []}, []), "Train.step: str '1' where int"),
        (_train({"step": True, "batch": []}, []), "Train.step: bool"),
        (_train({"step": 1, "batch": _tb(["int64", [2], 0])}, [8], b"\0" * 8), "needs 16"),
        (_train({"step": 1, "batch": _tb(["int64", [2], 0])}, [16]), "declare 16 bytes"),
        (_train({"step": 1, "batch": _tb(["object", [1], 0])}, [8], b"\0" * 8), "dtype"),
        (_train({"step": 1, "batch": _tb(["int64", [-1], 0])}, [8], b"\0" * 8), "shape"),
        (_train({"step": 1, "batch": _tb(["int64", [1], 5])}, [8], b"\0" * 8), "segment 5"),
        (_train({"step": 1, "batch": _tb({"__reduce__": 1})}, []), "tensor is declared"),
        (
            _train({"step": 1, "batch": {**_tb(["int64", [1], 0]), "evil": 1}}, [8], b"\0" * 8),
            r"Train.batch: fields \['evil'\] do not match TrainBatch's",
        ),
        (_train({"step": 1, "batch": [1] * 10}, []), r"Train.batch: expected the fields"),
        (_train({"step": 1, "batch": "[" * 100_000}, []), r"Train.batch: expected the fields"),
        (b"\x00\x00\x00\x03\xff\xfe\xfa", "not JSON"),
    ],
)
def test_bytes_that_are_not_a_declared_message_raise_one_codec_error(data, why):
    with pytest.raises(codec.CodecError, match=why):
        codec.decode(data, trn.COMMANDS)


def test_plain_values_come_back_only_as_plain_values():
    tagged = {"type": "Plain", "fields": {"result": [["x", {"object": "os.system"}]]}, "segs": []}
    with pytest.raises(codec.CodecError, match=r"'object' is not a plain value's tag"):
        codec.decode(_frame(tagged), PLAIN)
    for depth in (500, 50_000):  # past our own recursion, then past json's
        deep = '{"type":"Plain","fields":{"result":[["x",%s]]},"segs":[]}' % (
            "[" * depth + "]" * depth
        )
        with pytest.raises(codec.CodecError, match="nested too deeply"):
            codec.decode(len(deep).to_bytes(4, "big") + deep.encode(), PLAIN)
    with pytest.raises(codec.CodecError, match=r"Plain.result\['x'\]: a Example is not a plain"):
        codec.encode(Plain({"x": EXAMPLE}), PLAIN)
    with pytest.raises(codec.CodecError, match=r"Up.rank: str value where int"):
        codec.encode(gen.Up("1", [], "/m"), (gen.Up,))


class _Evil:
    """Unpickling this creates a file: what a pickle-reading reader would run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_pickle_is_never_unpickled(tmp_path):
    bomb = pickle.dumps(_Evil(tmp_path / "pwned"))
    for data in (bomb, len(bomb).to_bytes(4, "big") + bomb, _frame({"x": 1}) + bomb):
        with pytest.raises(codec.CodecError):
            codec.decode(data, trn.COMMANDS)
    assert not (tmp_path / "pwned").exists()


def test_the_codec_imports_nothing_that_runs_code_from_bytes():
    tree = ast.parse(Path(codec.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"pickle", "marshal", "importlib", "copyreg", "shelve", "dill"}
    calls = {
        f"{n.value.id}.{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }
    assert not calls & {"torch.load", "builtins.__import__", "sys.modules"}


# ------------------------------------------------------------------------- channels
@pytest.fixture
def store():
    return dist.HashStore()


def _raw(store, name: str, key: bytes = KEY) -> bytes:
    """The next value on channel ``name``'s queue, popped as is."""
    store.set_timeout(dt.timedelta(seconds=1))
    return store.queue_pop(channel_mod.queue_name(key, name))


def _push(store, name: str, value: bytes) -> None:
    """``value`` pushed as is onto channel ``name``'s queue (its name known)."""
    store.queue_push(channel_mod.queue_name(KEY, name), value)


def test_no_process_without_the_key_can_name_a_channels_queue(store):
    """What an outsider can pop is what it can name: the channel's name is not its queue's,
    and the queue's name depends on the key."""
    Channel(store, "reward/in/0", PLAIN, 5, key=KEY).put(Plain({"v": 1}))
    store.set_timeout(dt.timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError):
        store.queue_pop("reward/in/0")
    assert store.queue_len("reward/in/0") == 0
    assert channel_mod.queue_name(bytes(32), "reward/in/0") != channel_mod.queue_name(
        KEY, "reward/in/0"
    )
    assert Channel(store, "reward/in/0", PLAIN, 5, key=KEY).get(timeout=1) == Plain({"v": 1})


def test_a_channel_drops_forged_tampered_moved_and_replayed_messages(store, tmp_path, caplog):
    """Each bad value is dropped with one log line naming the channel and why; the
    reader gets the real message that follows, and nothing the bad ones name runs."""
    reader = Channel(store, "t/out", PLAIN, 5, key=KEY)
    writer = Channel(store, "t/out", PLAIN, 5, key=KEY)
    before = channel_mod.rejected_total()
    writer.put(Plain({"v": 1}))
    good = _raw(store, "t/out")  # the queue held only this
    bomb = pickle.dumps(_Evil(tmp_path / "pwned"))
    _push(store, "t/out", b"I" + bomb)  # a bare pickle
    _push(store, "t/out", b"I" + bytes(56) + bomb)  # framed, no valid tag
    _push(store, "t/out", b"")
    tampered = bytearray(good)
    tampered[-3] ^= 1
    _push(store, "t/out", bytes(tampered))
    Channel(store, "t/out", PLAIN, 5, key=bytes(32)).put(Plain({"v": 1}))  # other key
    _push(store, "t/out", _raw(store, "t/out", key=bytes(32)))
    Channel(store, "other", PLAIN, 5, key=KEY).put(Plain({"v": 1}))
    _push(store, "t/out", _raw(store, "other"))  # moved from another channel
    _push(store, "t/out", good)
    _push(store, "t/out", good)  # replayed
    writer.put(Plain({"v": 2}))
    with caplog.at_level(logging.WARNING, logger="rl.runtime.channel"):
        assert reader.get(timeout=2) == Plain({"v": 1})
        assert reader.get(timeout=2) == Plain({"v": 2})
    assert not (tmp_path / "pwned").exists()
    assert reader.rejected == 7 and channel_mod.rejected_total() - before == 7
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 7 and all(line.startswith("channel 't/out': dropped") for line in lines)
    assert sum("bad tag" in line for line in lines) == 5
    assert sum("replayed" in line for line in lines) == 1


def test_a_signed_but_undeclared_or_pickled_message_is_dropped(store, tmp_path, monkeypatch):
    """Past the tag, decoding still refuses what the reader does not declare, and a
    sender with the key that sends pickle gets nothing run either."""
    reader = Channel(store, "in", (trn.Push,), 5, key=KEY)
    Channel(store, "in", (trn.Push, trn.Save), 5, key=KEY).put(trn.Save("/x"))
    sender = Channel(store, "in", (trn.Push,), 5, key=KEY)
    bomb = pickle.dumps(_Evil(tmp_path / "pwned"))
    with monkeypatch.context() as m:
        m.setattr(codec, "encode", lambda msg, types: bomb)
        sender.put(trn.Push(1))
    sender.put(trn.Push(2))
    assert reader.get(timeout=2) == trn.Push(2)
    assert reader.rejected == 2 and not (tmp_path / "pwned").exists()


def test_get_keeps_its_deadline_through_bad_messages(store):
    reader = Channel(store, "q", (trn.Push,), 0.3, key=KEY)
    for _ in range(3):
        _push(store, "q", b"junk")
    with pytest.raises(ChannelTimeout, match="'q' within 0s"):
        reader.get()
    assert reader.rejected == 3


def test_chunked_messages_failures_and_type_checks_still_work(store, caplog):
    reader = Channel(store, "big", (trn.Train,), 5, key=KEY)
    writer = Channel(store, "big", (trn.Train,), 5, key=KEY)
    big = torch.arange(1_500_000, dtype=torch.float32)  # 6 MB: two chunks
    writer.put(trn.Train(1, TrainBatch(big.view(1, -1))))
    got = reader.expect(trn.Train, timeout=2)
    assert torch.equal(got.batch.tokens, big.view(1, -1))
    blob = f"{channel_mod.queue_name(KEY, 'big')}/blob/"
    writer.put(Failed("trainer", 1, "Traceback: ValueError: boom"))
    with pytest.raises(RemoteError, match="trainer rank 1 failed:\nTraceback: ValueError"):
        reader.get(timeout=2)
    with pytest.raises(ChannelError, match="carries Train, not Push"):
        writer.put(trn.Push(1))
    with pytest.raises(ChannelError, match=r"Train.batch.tokens: int value where Tensor"):
        writer.put(trn.Train(1, TrainBatch(3)))  # type: ignore[arg-type]
    _push(store, "big", b"B" + bytes(56) + json.dumps([f"{blob}never"]).encode())
    _push(store, "big", b"B" + bytes(56) + json.dumps(["trainer/in/0"]).encode())
    with pytest.raises(ChannelTimeout):
        reader.get(timeout=0.3)  # a forged descriptor does not block the reader
    assert reader.rejected == 2
    # Signed, but a chunk changed after it was written: dropped once fetched.
    fresh = Channel(store, "big", (trn.Train,), 5, key=KEY)  # its first message: sequence 1
    fresh.put(trn.Train(2, TrainBatch(big.view(1, -1))))
    chunk0 = f"{blob}{os.getpid()}-{fresh._writer.hex()}-1/0"
    store.set(chunk0, bytes(len(store.get(chunk0))))
    with pytest.raises(ChannelTimeout):
        reader.get(timeout=0.3)
    assert reader.rejected == 3
    assert "chunks do not match their descriptor's size and digest" in caplog.text


def test_a_message_over_the_limit_is_refused_by_its_writer(store, monkeypatch):
    import rl.runtime.channel as channel

    monkeypatch.setattr(channel, "MAX_BYTES", 5 << 20)
    writer = Channel(store, "huge", (trn.Train,), 5, key=KEY)
    with pytest.raises(ChannelError, match=r"'huge': a Train of \d+ bytes is over the 5242880"):
        writer.put(trn.Train(1, TrainBatch(torch.zeros(1, 1_500_000))))
