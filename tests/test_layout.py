"""The package's shape (issue 58): docs/DESIGN.md's "Layout" is the one map of heloco_jax/
(every module named, every name existing), tests/ has one folder per package, packages import
only those below them, nothing imports in a circle, only lm/ and cli/ read the CLI config, and
one arrival stays on a few files."""

import ast
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "heloco_jax"
# docs/DESIGN.md, "Layout": a package imports only those before it.
LAYERS = ["heloco_jax.outer", "heloco_jax.training", "heloco_jax.comm", "heloco_jax.rundir",
          "heloco_jax.runtime", "heloco_jax.api", "heloco_jax.lm", "heloco_jax.cli"]


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


def test_tests_mirror_the_packages():
  packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
  folders = {p.name for p in (ROOT / "tests").iterdir()
             if p.is_dir() and any(p.glob("test_*.py"))}
  assert packages == folders


def _type_only(tree: ast.AST) -> set[ast.AST]:
  """The imports under ``if TYPE_CHECKING:``: read by type checkers, never run."""
  return {child for node in ast.walk(tree) if isinstance(node, ast.If)
          and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
          for statement in node.body for child in ast.walk(statement)}


def _import_graph() -> dict[str, set[str]]:
  """Module -> the package modules it imports (module level and inside functions alike;
  an annotation's import under ``TYPE_CHECKING`` runs never, so it is no edge)."""
  modules = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  graph = {name: set() for name in modules}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    type_only = _type_only(tree)
    for node in ast.walk(tree):
      if node in type_only:
        continue
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                          + ([base] if base else []))
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
        targets = subs + ([base] if len(subs) < len(node.names) else [])
      else:
        continue
      graph[name].update(t for t in targets if t in modules and t != name)
  return graph


def test_the_package_has_no_import_circle():
  graph, done, cycles = _import_graph(), {}, []

  def visit(module, stack):
    done[module] = False
    stack.append(module)
    for other in sorted(graph[module]):
      if done.get(other) is False:
        cycles.append(" -> ".join(stack[stack.index(other):] + [other]))
      elif other not in done:
        visit(other, stack)
    stack.pop()
    done[module] = True

  for module in sorted(graph):
    if module not in done:
      visit(module, [])
  assert graph["heloco_jax.runtime.engine"] >= {"heloco_jax.runtime.loops"}
  assert not cycles, cycles


def _layer(module: str) -> int:
  return max(i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + "."))


def test_packages_import_only_the_packages_below_them():
  upward = [f"{module} -> {other}" for module, others in _import_graph().items()
            if module != "heloco_jax" for other in others
            if other != "heloco_jax" and _layer(other) > _layer(module)]
  assert not upward, upward


def test_only_lm_and_cli_read_the_cli_config():
  """No ``config.<CLI key>`` outside heloco_jax/lm and heloco_jax/cli, and no ml_collections."""
  from heloco_jax.cli.configs import default  # pylint: disable=g-import-not-at-top
  keys = set(default.get_config().keys())
  readers = []
  for path in PACKAGE.rglob("*.py"):
    if path.relative_to(PACKAGE).parts[0] in ("lm", "cli"):
      continue
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in ("config", "cfg") and node.attr in keys):
        readers.append(f"{path.relative_to(PACKAGE)}:{node.lineno} config.{node.attr}")
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
        if any(n.startswith("ml_collections") for n in names):
          readers.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports ml_collections")
  assert not readers, readers


def test_one_arrival_crosses_at_most_six_files_and_thirty_moves():
  """Issue 58: ``python -m benchmarks.arrival_path`` (a feature that is off adds no call to the
  arrival path: docs/DESIGN.md, "The engine"); today 6 files and 28 moves."""
  # On the CPU: an accelerator's default packed server also crosses outer/packing.py.
  out = subprocess.run([sys.executable, "-m", "benchmarks.arrival_path"], cwd=ROOT,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"},
                       capture_output=True, text=True, timeout=300, check=True).stdout
  files, moves = map(int, re.match(
      r"one arrival crosses (\d+) files, \d+ functions, (\d+) file-to-file moves", out).groups())
  assert files <= 6 and moves <= 30, out.splitlines()[:2]
