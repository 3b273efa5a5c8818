"""``python -m rl.simulate [--json PATH] [hydra overrides...]``: one RL step's time,
synchronous and asynchronous, for a GPU preset (e.g. ``experiment=llama3_405b_1024gpu``).

Exit status: 0 simulated, 2 the config is wrong or cannot be simulated (a Hydra typo, a
bad value, a CPU cluster), with a one-line reason on stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

USAGE = """usage: python -m rl.simulate [--json PATH] [overrides...]

Compose the config (the overrides of python -m rl.plan, e.g. experiment=llama3_8b_256gpu
cluster.hardware.train_mfu=0.35) and print one RL step's phases in the synchronous
baseline and in async mode, the speedup and where the time goes; --json PATH also writes
them, with every assumption and its source."""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    out: str | None = None
    args = list(argv)
    if "--json" in args:
        i = args.index("--json")
        if i + 1 >= len(args) or args[i + 1].startswith("-") or "=" in args[i + 1]:
            print("--json needs a path: --json PATH", file=sys.stderr)
            return 2
        out = args[i + 1]
        del args[i : i + 2]
    bad = [a for a in args if a.startswith("--")]
    if bad:
        print(f"unknown option {bad[0]} (options: --json PATH)\n{USAGE}", file=sys.stderr)
        return 2

    from omegaconf.errors import OmegaConfBaseException

    from rl.checks import compose_resolved
    from rl.config import ConfigError
    from rl.simulate.report import render, to_json
    from rl.simulate.simulation import simulate

    try:
        cfg = compose_resolved(args)
        sim = simulate(cfg)
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(render(sim))
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(to_json(sim, cfg), indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
