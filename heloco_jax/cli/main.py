"""The ``heloco-jax`` console script: dispatches to its subcommands."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """usage: heloco-jax COMMAND [ARGS]

commands:
  train    train with any method on simulated workers:
           heloco-jax train --workdir=DIR [--config=PATH.py] [--config.KEY=VALUE ...]
  corpus   build the offline multilingual corpus (and its BPE vocabulary):
           heloco-jax corpus debian_docs --languages=de,en,es,fr,it --out=DIR
           heloco-jax corpus bpe --out=DIR [--vocab-size=8192]   (any text_dir corpus)
  plot     a run's figures (loss, staleness, alignment, arrivals) as PNGs:
           heloco-jax plot RUN_DIR [RUN_DIR ...] [--out DIR]
"""


def _corpus(argv: Sequence[str]) -> int:
  from heloco_jax.lm.data import corpus  # pylint: disable=g-import-not-at-top
  return corpus.main(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(USAGE, end="")
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command == "train":
    from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
    return train.main(rest)
  if command == "corpus":
    return _corpus(rest)
  if command == "plot":
    from heloco_jax.cli import plot  # pylint: disable=g-import-not-at-top
    return plot.main(rest)
  print(f"heloco-jax: unknown command {command!r}; allowed: train, corpus, plot\n\n{USAGE}",
        end="", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
