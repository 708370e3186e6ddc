"""The quickstart config: HeLoCo on 5 simulated workers at the HeLoCo authors' mixed
paces (1, 2, 3, 1, 5 seconds per step), one synthetic language each (no download). Every
key, its default, what it allows and what it means are in one table,
``heloco_jax/cli/configs/schema.py``; ``heloco-jax train --help`` lists them (docs/DESIGN.md,
"Command line")."""

import ml_collections

from heloco_jax.cli.configs import schema


def get_config() -> ml_collections.ConfigDict:
  return schema.get_config()
