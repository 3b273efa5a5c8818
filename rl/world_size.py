"""Print the number of ranks a config's job needs (its role map), after validating it.

Used by launch scripts so that the rank count given to torchrun/srun comes from the same
composed config the ranks will read: ``python -m rl.world_size [overrides...]``.
"""

from __future__ import annotations

import sys

from rl.checks import check
from rl.compose import compose
from rl.config import ConfigError
from rl.config.roles import RoleMap


def main(argv: list[str]) -> int:
    cfg = compose(argv)
    try:
        check(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(RoleMap.from_config(cfg).world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
