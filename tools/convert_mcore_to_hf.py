#!/usr/bin/env python
"""Convert a Megatron torch_dist checkpoint (any TP/PP) to a Hugging Face directory.

Example (from the repo root, with the project venv):

    python tools/convert_mcore_to_hf.py --ckpt outputs/tiny_sft/checkpoint --out ./tiny-hf

Works on checkpoints written by the trainer or by tools/convert_hf_to_mcore.py (both carry
the model config). Streams one layer at a time into safetensors shards with an index,
writes config.json and generation_config.json (the original ones when the checkpoint came
from Hugging Face), and copies tokenizer files when given. The result loads with
``transformers.AutoModelForCausalLM.from_pretrained``. The output appears only when complete.

A LoRA checkpoint is written merged (``W + s B A``), or with ``--peft`` as its adapters
alone in PEFT's format, for ``peft.PeftModel.from_pretrained`` on the base model:

    python tools/convert_mcore_to_hf.py --ckpt outputs/run/checkpoint --out ./adapter \\
        --peft --base-model ./SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parser() -> argparse.ArgumentParser:
    from rl.config.dtypes import PARAM_DTYPES

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--ckpt", required=True, help="Megatron torch_dist checkpoint directory")
    p.add_argument("--out", required=True, help="Hugging Face directory to write")
    p.add_argument(
        "--arch",
        default=None,
        help="architecture to write, a registered family's HF class (default: the model's\n"
        "own, model.architecture in the checkpoint)",
    )
    p.add_argument(
        "--dtype",
        choices=PARAM_DTYPES,
        default=None,
        help="dtype of the written tensors (default: the checkpoint's)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors shard, e.g. 500MB or 5GB (default 5GB)",
    )
    p.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from here")
    p.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA checkpoint: write its adapters alone as a PEFT adapter directory\n"
        "(adapter_config.json, adapter_model.safetensors) instead of the merged model",
    )
    p.add_argument(
        "--base-model",
        default=None,
        help="with --peft: the HF model the adapters adapt (its base_model_name_or_path)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace --out if it already exists (default: refuse)"
    )
    return p


def parse_size(text: str) -> int:
    """'500MB' / '5GB' / '1024' (bytes) -> bytes."""
    units = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?B?)\s*", text.upper())
    value = int(float(match.group(1)) * units[match.group(2)]) if match else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--max-shard-size={text!r} is not a positive size")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from rl.runtime.launch import quiet_known_warnings

    quiet_known_warnings()  # before Megatron is imported: some of its warnings fire then
    from rl.config.errors import ConfigError
    from rl.config.prelaunch import check_output_dir
    from rl.weights.convert import mcore_to_hf
    from rl.weights.dist_ckpt import CheckpointError
    from rl.weights.hf_config import HFConfigError
    from rl.weights.peft_export import mcore_to_peft

    out = Path(args.out)
    try:
        max_bytes = parse_size(args.max_shard_size)
        if out.exists() and not args.force:
            raise FileExistsError(f"--out {str(out)!r} exists (pass --force to replace it)")
        # Written beside its final name, then renamed: the parent must take files, which
        # is checked before any rank starts or any shard is written.
        check_output_dir(str(out.parent), f"--out {str(out)!r}: its parent")
        if args.peft:
            p = mcore_to_peft(args.ckpt, str(out), args.base_model)
        else:
            s = mcore_to_hf(args.ckpt, str(out), args.arch, args.dtype, max_bytes,
                            args.tokenizer_dir)  # fmt: skip
    except (CheckpointError, ConfigError, HFConfigError, FileExistsError, FileNotFoundError,
            argparse.ArgumentTypeError) as e:  # fmt: skip
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.peft:
        on = ", ".join(p["target_modules"])
        print(f"wrote {out}: PEFT LoRA adapters of rank {p['rank']} on {on}, "
              f"{p['tensors']} tensors, {p['seconds']:.1f}s")  # fmt: skip
        return 0
    print(
        f"wrote {out}: {s['architecture']}, {s['tensors']} tensors in {s['shards']} shard(s), "
        f"tokenizer files {s['tokenizer_files'] or 'none'}, {s['seconds']:.1f}s, "
        f"peak RSS {s['peak_rss_mb'][0]:.0f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
