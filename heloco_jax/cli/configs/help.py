"""The config keys as `heloco-jax train --help` lists them.

``describe(config)`` gives one line per key (dotted, e.g.
``outer.keep_threshold``) with its value in ``config`` (the default, for
``default.get_config()``) and what is allowed, and under it a line saying
what the key means, grouped by section; all three come from the one table,
``heloco_jax.cli.configs.schema``. docs/DESIGN.md ("Command line") has the
contract.
"""

from __future__ import annotations

from typing import Any, Iterator

import ml_collections

from heloco_jax.cli.configs import schema


def leaves(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """(dotted key, value) of every leaf of ``config``."""
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def _show(value: Any) -> str:
  """A value as it is written on the command line ('' for the empty string, unset for None)."""
  if value is None:
    return "unset"
  if isinstance(value, str):
    return value if value else "''"
  if isinstance(value, (list, tuple)):
    return ",".join(str(v) for v in value)
  return str(value)


def _allowed(key: str, value: Any) -> str:
  if key in schema.BY_NAME:
    return schema.BY_NAME[key].check.allowed
  if isinstance(value, bool):
    return "True or False"
  if isinstance(value, int):
    return "an integer"
  if isinstance(value, float):
    return "a number"
  return "a string"


def describe(config: ml_collections.ConfigDict) -> str:
  """The help text of ``config``'s keys: key, default, allowed values, meaning.

  Args:
    config: a run config, e.g. ``heloco_jax.cli.configs.default.get_config()``;
      its values are shown as the defaults.

  Returns:
    Lines grouped by section: a section title, then per key
    ``  key  default  allowed`` and an indented line with its meaning.
    Keys the tables do not know are listed too, with what their type allows.
  """
  order = {key.name: i for i, key in enumerate(schema.KEYS)}  # the table's order
  rows = sorted(leaves(config), key=lambda row: (order.get(row[0], len(order)), row[0]))
  width = max((len(key) for key, _ in rows), default=0)
  value_width = min(max((len(_show(v)) for _, v in rows), default=0), 12)
  sections: dict[str, list[str]] = {}
  for key, value in rows:
    section = key.rsplit(".", 1)[0] if "." in key else ""
    lines = sections.setdefault(section, [])
    lines.append(f"  {key:<{width}}  {_show(value):<{value_width}}  {_allowed(key, value)}")
    if key in schema.BY_NAME:
      lines.append(f"  {'':<{width}}    {schema.BY_NAME[key].meaning}")
  out = []
  known = {name: i for i, name in enumerate(schema.SECTIONS)}
  for section in sorted(sections, key=lambda name: (known.get(name, len(known)), name)):
    lines = sections[section]
    out.append(schema.SECTIONS.get(section, section))
    out.extend(lines)
    out.append("")
  return "\n".join(out).rstrip() + "\n"
