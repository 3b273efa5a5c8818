"""The channels' wire format: a JSON header plus raw tensor bytes, decoded by schema only.

Why not pickle (``torch.save``/``torch.load``): the job's store listens on every
interface, and unpickling bytes popped from it lets whoever reaches its port run code in
the controller or an executor. Here decoding never names, imports or calls anything the
bytes choose: the header names a message type, which is looked up only among the types
the channel declares, and every field is rebuilt from that dataclass's type hints
(``typing.get_type_hints``), recursively. What the hints do not allow is a
:class:`CodecError`, one line naming the field.

A message is ``len(header) (4 bytes, big-endian) | header (JSON) | segments``. The header
holds ``type`` (the class's ``__qualname__``), ``fields`` and ``segs`` (the byte length of
each raw segment, in order). Tensors and ``bytes`` are segments, referenced by index:
a tensor as ``[dtype name, shape, segment]``. Per hint, a value is encoded as:

- ``None``, ``bool``, ``int``, ``float`` (NaN and infinities too), ``str``: JSON itself;
- ``list``/``Sequence``, ``tuple`` (fixed or ``...``): a JSON list;
- ``dict``/``Mapping``: a JSON list of ``[key, value]`` pairs (keys need not be strings);
- a union (``X | None``): ``[arm index, value]``;
- a dataclass: a JSON object of its ``__init__`` fields, all of them, no others;
- ``Any``: a plain value (JSON scalars, lists, dicts, tuples, bytes, tensors, ``Decimal``
  and ``datetime`` values, which parquet rows hold), each container tagged by a one-key
  object (``{"tuple": [...]}``, ``{"dict": [...]}``...). Never a dataclass or any other
  class: only the declared schema builds objects.

Stdlib and torch only: this module sits under :mod:`rl.runtime.channel`.
"""

from __future__ import annotations

import collections.abc as cabc
import dataclasses
import datetime as dt
import decimal
import functools
import itertools
import json
import math
import numbers
import types
import typing
from typing import Any

import torch

MAX_DIMS = 64  # more than any real tensor has; bounds the work a header can ask for

# Every dtype a tensor may carry on a channel: batches (int64, float32), metrics, masks.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_SCALARS = (bool, int, float, str, bytes)
_SEQUENCES = (list, cabc.Sequence, cabc.MutableSequence)
_MAPPINGS = (dict, cabc.Mapping, cabc.MutableMapping)


# A type hint as get_type_hints gives it (a class, or list[int], X | None, ...).
Hint = object
# A value of the JSON header (dict, list, str, int, float, bool or None): JSON has no
# static type, so it stays Any, here only.
Json = Any


class CodecError(ValueError):
    """A message that cannot be encoded, or bytes that are not a message of the declared
    types (unknown type, wrong fields, wrong value types, bad dtype, sizes that disagree)."""


def type_name(cls: type) -> str:
    return cls.__qualname__


def check_types(declared: cabc.Iterable[type]) -> None:
    """Fail now, naming the field, if a declared type holds anything the codec cannot
    carry (or an annotation that does not resolve at run time)."""
    names: dict[str, type] = {}
    for cls in declared:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise CodecError(f"{cls!r} is not a dataclass: a channel carries dataclasses")
        if names.setdefault(type_name(cls), cls) is not cls:
            raise CodecError(f"two declared types are named {type_name(cls)!r}")
        _check(cls, type_name(cls), set())


def encode(msg: object, declared: cabc.Iterable[type]) -> bytes:
    """The bytes of ``msg``, which must be an instance of one of ``declared``."""
    cls = type(msg)
    if cls not in tuple(declared):
        raise CodecError(f"{cls.__qualname__} is not one of the declared types")
    segs: list[bytes] = []
    fields = _enc_dataclass(msg, cls, type_name(cls), segs)
    header = {"type": type_name(cls), "fields": fields, "segs": [len(s) for s in segs]}
    try:
        head = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as e:  # a bug here, not in the message
        raise CodecError(f"{type_name(cls)}: header not serialisable ({e})") from None
    return b"".join([len(head).to_bytes(4, "big"), head, *segs])


def decode(data: bytes | bytearray | memoryview, declared: cabc.Iterable[type]) -> object:
    """The message in ``data``, built only from ``declared``'s schemas; :class:`CodecError`
    for anything else (nothing named by the bytes is imported or called)."""
    try:
        return _decode(memoryview(data), {type_name(t): t for t in declared})
    except CodecError:
        raise
    except RecursionError:
        raise CodecError("message nested too deeply") from None
    except Exception as e:  # a declared type's own __init__/__post_init__ refused a value
        raise CodecError(f"undecodable message ({type(e).__name__}: {e})") from None


# ------------------------------------------------------------------------------ schema
@functools.cache
def _hints(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(name, hint)`` of the dataclass's ``__init__`` fields, annotations resolved."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception as e:  # NameError: a type imported only under TYPE_CHECKING
        raise CodecError(
            f"{cls.__qualname__}: field annotations do not resolve at run time ({e}); "
            f"import the type at run time in {cls.__module__}"
        ) from None
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def _shape(hint: Hint) -> tuple[Hint, tuple[Hint, ...]]:
    """``(kind, args)`` of a hint: the one place that tells hints apart."""
    if hint is Any or hint is object:
        return "any", ()
    if hint is None or hint is type(None):
        return "none", ()
    if hint in _SCALARS:
        return hint, ()
    if hint is torch.Tensor:
        return "tensor", ()
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "dataclass", (hint,)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return "union", args
    if origin is typing.Literal:
        return "literal", args
    if hint in _SEQUENCES or origin in _SEQUENCES:
        return "list", args or (Any,)
    if hint is tuple or origin is tuple:
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            return "list", args[:1] or (Any,)
        return "tuple", args
    if hint in _MAPPINGS or origin in _MAPPINGS:
        return "dict", args or (Any, Any)
    raise CodecError(f"type {hint!r} cannot travel on a channel")


def _check(hint: Hint, where: str, seen: set[type]) -> None:
    try:
        kind, args = _shape(hint)
    except CodecError as e:
        raise CodecError(f"{where}: {e}") from None
    if kind == "dataclass" and isinstance(hint, type):  # _shape says it is a class
        if hint in seen:
            return
        seen.add(hint)
        for name, sub in _hints(hint):
            _check(sub, f"{where}.{name}", seen)
    elif kind != "literal":
        for sub in args:
            _check(sub, where, seen)


# ------------------------------------------------------------------------------ encode
def _enc_dataclass(obj: object, cls: type, where: str, segs: list[bytes]) -> dict[str, Any]:
    return {n: _enc(getattr(obj, n), h, f"{where}.{n}", segs) for n, h in _hints(cls)}


def _enc(v: object, hint: Hint, where: str, segs: list[bytes]) -> Json:
    kind, args = _shape(hint)
    if kind == "any":
        return _enc_any(v, where, segs)
    if kind == "none" and v is None:
        return None
    if kind is bool and isinstance(v, bool):
        return v
    if kind is int and isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    if kind is float and isinstance(v, numbers.Real) and not isinstance(v, bool):
        return float(v)
    if kind is str and isinstance(v, str):
        return v
    if kind is bytes and isinstance(v, (bytes, bytearray)):
        return _seg(segs, bytes(v))
    if kind == "tensor" and isinstance(v, torch.Tensor):
        return _enc_tensor(v, where, segs)
    if kind == "dataclass" and type(v) is args[0]:
        return _enc_dataclass(v, args[0], where, segs)
    if kind == "literal" and v in args:
        return v
    if kind == "list" and isinstance(v, (list, tuple)):
        return [_enc(x, args[0], f"{where}[{i}]", segs) for i, x in enumerate(v)]
    if kind == "tuple" and isinstance(v, (list, tuple)) and len(v) == len(args):
        return [
            _enc(x, h, f"{where}[{i}]", segs) for i, (x, h) in enumerate(zip(v, args, strict=True))
        ]
    if kind == "dict" and isinstance(v, cabc.Mapping):
        return [
            [_enc(k, args[0], f"{where} key", segs), _enc(x, args[1], f"{where}[{k!r}]", segs)]
            for k, x in v.items()
        ]
    if kind == "union":
        for i, arm in enumerate(args):
            try:
                return [i, _enc(v, arm, where, segs)]
            except CodecError:
                continue
    raise CodecError(f"{where}: {type(v).__name__} value where {_name(hint)} is declared")


def _enc_any(v: object, where: str, segs: list[bytes]) -> Json:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real) and not isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, list):
        return [_enc_any(x, f"{where}[{i}]", segs) for i, x in enumerate(v)]
    if isinstance(v, tuple):
        return {"tuple": [_enc_any(x, f"{where}[{i}]", segs) for i, x in enumerate(v)]}
    if isinstance(v, cabc.Mapping):
        pairs = [[_enc_any(k, f"{where} key", segs), _enc_any(x, f"{where}[{k!r}]", segs)]
                 for k, x in v.items()]  # fmt: skip
        return {"dict": pairs}
    if isinstance(v, (bytes, bytearray)):
        return {"bytes": _seg(segs, bytes(v))}
    if isinstance(v, torch.Tensor):
        return {"tensor": _enc_tensor(v, where, segs)}
    if isinstance(v, decimal.Decimal):
        return {"decimal": str(v)}
    if isinstance(v, dt.datetime):  # before date: a datetime is a date
        return {"datetime": v.isoformat()}
    if isinstance(v, (dt.date, dt.time)):
        return {type(v).__name__: v.isoformat()}
    if isinstance(v, dt.timedelta):
        return {"timedelta": [v.days, v.seconds, v.microseconds]}
    raise CodecError(f"{where}: a {type(v).__name__} is not a plain value (declared Any)")


def _enc_tensor(t: torch.Tensor, where: str, segs: list[bytes]) -> list[Any]:
    if t.dtype not in _DTYPE_NAMES or t.layout != torch.strided:
        raise CodecError(f"{where}: tensor of {t.dtype} ({t.layout}) cannot travel")
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return [_DTYPE_NAMES[t.dtype], list(t.shape), _seg(segs, raw)]


def _seg(segs: list[bytes], raw: bytes) -> int:
    segs.append(raw)
    return len(segs) - 1


def _name(hint: Hint) -> str:
    return getattr(hint, "__qualname__", None) or str(hint).replace("typing.", "")


# ------------------------------------------------------------------------------ decode
class _Segments:
    """The raw segments after the header, checked against their declared lengths."""

    def __init__(self, blob: memoryview, sizes: object):
        if not isinstance(sizes, list) or not all(_is_int(n) and n >= 0 for n in sizes):
            raise CodecError("header 'segs' is not a list of byte lengths")
        if sum(sizes) != len(blob):
            raise CodecError(f"segments declare {sum(sizes)} bytes, the message has {len(blob)}")
        self.blob, self.starts = blob, [0, *itertools.accumulate(sizes)]

    def get(self, i: object, where: str) -> memoryview:
        if not _is_int(i) or not 0 <= i < len(self.starts) - 1:
            raise CodecError(f"{where}: segment {i!r} does not exist")
        return self.blob[self.starts[i] : self.starts[i + 1]]


def _decode(data: memoryview, by_name: dict[str, type]) -> object:
    if len(data) < 4:
        raise CodecError(f"{len(data)} bytes: too short for a message")
    n = int.from_bytes(data[:4], "big")
    if 4 + n > len(data):
        raise CodecError(f"header of {n} bytes overruns the {len(data)}-byte message")
    try:
        header = json.loads(bytes(data[4 : 4 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise CodecError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict) or set(header) != {"type", "fields", "segs"}:
        raise CodecError("header is not {type, fields, segs}")
    name = header["type"]
    cls = by_name.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CodecError(f"type {str(name)[:80]!r} is not one this channel carries")
    segs = _Segments(data[4 + n :], header["segs"])
    return _dec_dataclass(header["fields"], cls, type_name(cls), segs)


def _dec_dataclass(v: Json, cls: type, where: str, segs: _Segments) -> object:
    hints = _hints(cls)
    if not isinstance(v, dict):
        raise CodecError(f"{where}: expected the fields of {cls.__qualname__}")
    want = {n for n, _ in hints}
    if set(v) != want:
        odd = sorted(set(v) ^ want)
        raise CodecError(f"{where}: fields {odd} do not match {cls.__qualname__}'s")
    return cls(**{n: _dec(v[n], h, f"{where}.{n}", segs) for n, h in hints})


def _dec(v: Json, hint: Hint, where: str, segs: _Segments) -> Json:
    kind, args = _shape(hint)
    if kind == "any":
        return _dec_any(v, where, segs)
    if kind == "none" and v is None:
        return None
    if kind is bool and isinstance(v, bool):
        return v
    if kind is int and _is_int(v):
        return v
    if kind is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if kind is str and isinstance(v, str):
        return v
    if kind is bytes:
        return bytes(segs.get(v, where))
    if kind == "tensor":
        return _dec_tensor(v, where, segs)
    if kind == "dataclass" and isinstance(cls := args[0], type):
        return _dec_dataclass(v, cls, where, segs)
    if kind == "literal" and any(v == a and type(v) is type(a) for a in args):
        return v
    if kind == "list" and isinstance(v, list):
        items = [_dec(x, args[0], f"{where}[{i}]", segs) for i, x in enumerate(v)]
        return tuple(items) if hint is tuple or typing.get_origin(hint) is tuple else items
    if kind == "tuple" and isinstance(v, list) and len(v) == len(args):
        return tuple(
            _dec(x, h, f"{where}[{i}]", segs) for i, (x, h) in enumerate(zip(v, args, strict=True))
        )
    if kind == "dict" and isinstance(v, list) and all(_is_pair(p) for p in v):
        return {
            _key(_dec(k, args[0], f"{where} key", segs), where): _dec(x, args[1], where, segs)
            for k, x in v
        }
    if kind == "union" and _is_pair(v) and _is_int(v[0]) and 0 <= v[0] < len(args):
        return _dec(v[1], args[v[0]], where, segs)
    raise CodecError(f"{where}: {_describe(v)} where {_name(hint)} is declared")


def _dec_any(v: Json, where: str, segs: _Segments) -> Json:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_dec_any(x, f"{where}[{i}]", segs) for i, x in enumerate(v)]
    if not (isinstance(v, dict) and len(v) == 1):
        raise CodecError(f"{where}: {_describe(v)} is not a tagged plain value")
    ((tag, x),) = v.items()
    if tag == "tuple" and isinstance(x, list):
        return tuple(_dec_any(y, f"{where}[{i}]", segs) for i, y in enumerate(x))
    if tag == "dict" and isinstance(x, list) and all(_is_pair(p) for p in x):
        return {_key(_dec_any(k, where, segs), where): _dec_any(y, where, segs) for k, y in x}
    if tag == "bytes":
        return bytes(segs.get(x, where))
    if tag == "tensor":
        return _dec_tensor(x, where, segs)
    if tag in _PLAIN and isinstance(x, str):
        try:
            return _PLAIN[tag](x)
        except (ValueError, decimal.InvalidOperation):
            raise CodecError(f"{where}: {x[:40]!r} is not a {tag}") from None
    if tag == "timedelta" and isinstance(x, list) and len(x) == 3 and all(map(_is_int, x)):
        return dt.timedelta(days=x[0], seconds=x[1], microseconds=x[2])
    raise CodecError(f"{where}: {str(tag)[:40]!r} is not a plain value's tag")


_PLAIN: dict[str, cabc.Callable[[str], Any]] = {
    "decimal": decimal.Decimal,
    "datetime": dt.datetime.fromisoformat,
    "date": dt.date.fromisoformat,
    "time": dt.time.fromisoformat,
}


def _dec_tensor(v: Json, where: str, segs: _Segments) -> torch.Tensor:
    if not (isinstance(v, list) and len(v) == 3):
        raise CodecError(f"{where}: {_describe(v)} where a tensor is declared")
    name, shape, seg = v
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CodecError(f"{where}: dtype {str(name)[:40]!r} is not one of {', '.join(_DTYPES)}")
    sizes_ok = isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
    if not sizes_ok or len(shape) > MAX_DIMS:
        raise CodecError(f"{where}: shape {str(shape)[:80]} is not a list of sizes")
    raw = segs.get(seg, where)
    need = math.prod(shape) * dtype.itemsize
    if len(raw) != need:
        raise CodecError(f"{where}: {name}{shape} needs {need} bytes, the message has {len(raw)}")
    if not need:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _is_int(v: object) -> typing.TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_pair(v: object) -> bool:
    return isinstance(v, list) and len(v) == 2


def _key(k: object, where: str) -> Json:
    if not isinstance(k, cabc.Hashable):
        raise CodecError(f"{where}: a {type(k).__name__} cannot be a dict key")
    return k


def _describe(v: object) -> str:
    """A received value, short: its JSON type, and the value itself if it is a scalar."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return f"{type(v).__name__} {str(v)[:40]!r}"
    return type(v).__name__
