"""docs/DESIGN.md's "Layout" is the one map of the package (issue 58): every module of
heloco_jax/ is named in it, and every module it names exists."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _map() -> str:
  design = (ROOT / "docs" / "DESIGN.md").read_text()
  section = design.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
  return re.search(r"```\n(.*?)```", section, re.S).group(1)


def _named() -> set[str]:
  """The modules the map names, as paths under heloco_jax/: entries (``server.py``,
  ``runtime/`` then ``  loops.py``) and the ``x.py`` a folder's description lists."""
  named, folders, inline = set(), {}, None  # folders: indent -> "runtime/"
  lines = _map().split("heloco_jax/\n", 1)[1].splitlines()
  for line in lines:
    if not line.startswith(" "):
      break  # the package ends where the next top-level folder begins
    if line.lstrip().startswith("#"):
      continue
    indent = len(line) - len(line.lstrip())
    if indent < 10:  # an entry; descriptions start further right
      token, inline = line.split()[0], None
      folders = {i: f for i, f in folders.items() if i < indent}
      prefix = "".join(folders[i] for i in sorted(folders))
      if token.endswith("/"):
        folders[indent] = token
        inline = prefix + token
      else:
        named.add(prefix + token)
    if inline:
      named.update(inline + module for module in re.findall(r"\b(\w+\.py)\b", line))
  return named


def test_every_module_is_on_the_map_and_every_name_on_it_exists():
  on_disk = {str(p.relative_to(ROOT / "heloco_jax")) for p in (ROOT / "heloco_jax").rglob("*.py")
             if p.name != "__init__.py"}
  named = _named()
  assert on_disk - named == set(), "modules missing from docs/DESIGN.md's map"
  assert named - on_disk == set(), "names on docs/DESIGN.md's map that do not exist"
