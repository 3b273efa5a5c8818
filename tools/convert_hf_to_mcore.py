#!/usr/bin/env python
"""Convert a Hugging Face checkpoint (Llama / Qwen2, safetensors) to Megatron torch_dist.

Examples (from the repo root, with the project venv):

    python tools/convert_hf_to_mcore.py --hf-dir ./llama --out ./llama-mcore --tp 2 --pp 2
    python -m rl.runtime.torchrun --nproc-per-node 4 tools/convert_hf_to_mcore.py --tp 2 ...
    srun python -m rl.runtime.torchrun ... tools/convert_hf_to_mcore.py ...   # on SLURM

(``rl.runtime.torchrun`` is torchrun with its stores on one address, not every interface;
plain ``torchrun`` works as well.)

Without a launcher it starts tp*pp local ranks itself. The output loads into the trainer
at any TP/PP (``trainer.load_dir=...``) and carries the model config and the original
config.json, which tools/convert_mcore_to_hf.py uses on the way back. Inputs are validated
before any rank starts; the output appears only when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parser() -> argparse.ArgumentParser:
    from rl.config.dtypes import PARAM_DTYPES

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--hf-dir", required=True, help="Hugging Face model directory to read")
    p.add_argument("--out", required=True, help="Megatron checkpoint directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size for MoE models (default 1)"
    )
    p.add_argument(
        "--vocab-multiple",
        type=int,
        default=128,
        help="pad embedding/output rows to a multiple of this and of --tp (default 128);\n"
        "0 disables padding, and then --tp must divide the vocab",
    )
    p.add_argument(
        "--dtype",
        choices=PARAM_DTYPES,
        default=None,
        help="parameter dtype of the Megatron checkpoint (default: the HF checkpoint's)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace --out if it already exists (default: refuse)"
    )
    return p


# The trainer's checks name its config fields; here the user typed flags.
FLAGS = {"trainer.tp=": "--tp=", "trainer.pp=": "--pp=", "trainer.ep=": "--ep="}


def as_flags(message: str) -> str:
    """``message`` with the trainer fields it names spelled as this tool's flags."""
    for field, flag in FLAGS.items():
        message = message.replace(field, flag)
    return message


def bad_count(args: argparse.Namespace) -> str | None:
    """The first numeric flag out of range, named as the user typed it."""
    for flag, low in (("--tp", 1), ("--pp", 1), ("--ep", 1), ("--vocab-multiple", 0)):
        v = getattr(args, flag[2:].replace("-", "_"))
        if v < low:
            return f"{flag}={v} must be an integer >= {low}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if problem := bad_count(args):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from rl.runtime.launch import quiet_known_warnings

    quiet_known_warnings()  # before Megatron is imported: some of its warnings fire then
    from rl.config.errors import ConfigError
    from rl.config.prelaunch import check_output_dir
    from rl.weights.convert import hf_to_mcore, hf_to_mcore_rank, prepare_hf_to_mcore
    from rl.weights.hf_config import HFConfigError
    from rl.weights.hf_io import HFCheckpointError

    out = Path(args.out)
    try:
        if out.exists() and not args.force:
            raise FileExistsError(f"--out {str(out)!r} exists (pass --force to replace it)")
        # Written beside its final name, then renamed: the parent must take files, which
        # is checked before any rank starts or any shard is written.
        check_output_dir(str(out.parent), f"--out {str(out)!r}: its parent")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            from rl.runtime.launch import setup_rank

            m, dtype = prepare_hf_to_mcore(args.hf_dir, args.tp, args.pp, args.vocab_multiple,
                                           args.dtype, args.ep)  # fmt: skip
            world, ranks = int(os.environ["WORLD_SIZE"]), args.tp * args.pp * args.ep
            if world != ranks:
                raise ConfigError(f"--tp*--pp*--ep={ranks} but WORLD_SIZE={world}")
            setup_rank("cpu", threads=1)
            summary = hf_to_mcore_rank(args.hf_dir, str(out), m, args.tp, args.pp, dtype, args.ep)
            if int(os.environ["RANK"]) != 0:
                return 0
        else:
            summary = hf_to_mcore(
                args.hf_dir, str(out), args.tp, args.pp, args.vocab_multiple, args.dtype, args.ep
            )
    except (ConfigError, HFConfigError, HFCheckpointError, FileExistsError) as e:
        print(f"error: {as_flags(str(e))}", file=sys.stderr)
        return 2
    rss = summary["peak_rss_mb"]
    print(
        f"wrote {out} (tp={args.tp}, pp={args.pp}, ep={args.ep}): {summary['tensors']} shards "
        f"of tensors in {summary['seconds']:.1f}s; peak RSS per rank {max(rss):.0f} MB "
        f"({', '.join(f'{r:.0f}' for r in rss)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
