"""``heloco-jax train``: the training CLI (DESIGN.md, "Command line").

The scheduler, methods and outputs land with the "Scheduler, methods and
CLI" issue; until then this command says so clearly and exits with status 2.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

NOT_YET = (
    "heloco-jax train: not yet available. The outer rules (hj.heloco, hj.mla, "
    "hj.async_nesterov, hj.delayed_nesterov) are ready to use from Python; the "
    "scheduler, methods and training CLI land with the 'Scheduler, methods and CLI' issue.")


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not any(a.startswith("--workdir=") for a in argv) and "--workdir" not in argv:
    print("heloco-jax train: --workdir is required; usage: heloco-jax train --workdir=DIR "
          "[--config=PATH.py] [--config.KEY=VALUE ...]", file=sys.stderr)
    return 2
  print(NOT_YET, file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
