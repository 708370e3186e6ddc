"""What a workdir written by an earlier version of heloco_jax resumes with (docs/DESIGN.md,
"Files a run writes").

``hj.simulate(workdir=...)``'s ``config.json`` records ``config_schema`` (``SCHEMA_VERSION``)
and every resolved value of the run. A resume compares it with the call, key by key
(``workdir.config_differences``): a key an older ``config.json`` did not record is taken at
the value in ``ADDED`` below, or else at the ``RunSpec`` field's default (a field is added
with the default that keeps the old behaviour), so only a key whose *recorded* value differs
from the call's is refused. A ``config_schema`` newer than this library's is refused: its
keys may mean what this version cannot read.

The CLI's ``config.json`` is its resolved config: a key absent there is taken at the
default of ``heloco_jax/cli/configs/schema.py`` (``--workdir`` passes them), and a renamed
key under its former name (``schema.RENAMED``).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping

SCHEMA_VERSION = 1
SCHEMA_KEY = "config_schema"

# Keys of the API's config.json (dotted) an earlier layout did not record, and the value
# that reproduces how such a run ran, where it is not the RunSpec field's default
# (``spec_defaults``). Add a row with every key whose absent value means something else.
ADDED: Mapping[str, Any] = MappingProxyType({
    SCHEMA_KEY: 0,  # a config.json without it: the layout before versions were recorded
})


def spec_defaults(spec: Any) -> dict[str, Any]:
  """The defaults of ``spec``'s (a ``RunSpec``'s) fields that have one, by field name."""
  out = {}
  for field in dataclasses.fields(spec):
    if field.default is not dataclasses.MISSING:
      out[field.name] = field.default
    elif field.default_factory is not dataclasses.MISSING:
      out[field.name] = field.default_factory()
  return out


def check_version(recorded: Mapping[str, Any], path: str, flag: str) -> None:
  """Refuses a ``config.json`` of a newer layout than this library's (one line)."""
  version = recorded.get(SCHEMA_KEY, ADDED[SCHEMA_KEY])
  if isinstance(version, bool) or not isinstance(version, int) or version > SCHEMA_VERSION:
    raise ValueError(f"{path} records {SCHEMA_KEY}={version!r}, a layout newer than this "
                     f"heloco_jax's ({SCHEMA_VERSION}); allowed: resume it with the version "
                     f"that wrote it (or newer), or use a new {flag}")
