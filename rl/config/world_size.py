"""Print the number of trainer ranks a config needs (tp*pp*dp), after validating it.

Used by launch scripts so that the rank count given to torchrun/srun comes from the same
composed config the ranks will read: ``python -m rl.config.world_size [overrides...]``.
"""

from __future__ import annotations

import sys

from rl.config import ConfigError, compose, validate


def main(argv: list[str]) -> int:
    cfg = compose(argv)
    t = cfg.trainer
    try:
        validate(cfg, world_size=t.tp * t.pp * t.dp)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(t.tp * t.pp * t.dp)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
