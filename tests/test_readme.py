"""The README's Python example runs as written, and its commands match the project."""

import pathlib
import re

import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_example_runs_and_moves_params():
  blocks = [block for block in re.findall(r"```python\n(.*?)```", README, flags=re.S)
            if "hj.heloco_diagnostics" in block]
  assert blocks, "README has no example of the outer rules"
  namespace: dict = {}
  exec(compile(blocks[0], "README.md", "exec"), namespace)  # pylint: disable=exec-used
  params, logs, start = namespace["params"], namespace["logs"], namespace["start"]
  assert float(jnp.abs(params["w"] - 1.0).max()) > 0  # the update moved θ
  assert int(logs["staleness"]) == 2
  assert set(start) == {"w", "b"}


def test_readme_test_command_is_what_ci_runs():
  ci = (ROOT / ".ci" / "run").read_text()
  assert "python -m pytest" in README and ci.rstrip().endswith("python -m pytest")
  assert 'pip install -e ".[dev]"' in README and 'pip install --quiet -e ".[dev]"' in ci


def test_the_readme_is_a_front_door_and_every_page_it_sends_to_is_in_the_site():
  # Issue 58: at most 250 lines; the manual lives in docs/ pages of the mkdocs nav.
  assert len(README.splitlines()) <= 250
  nav = (ROOT / "mkdocs.yml").read_text()
  for page in sorted(set(re.findall(r"\(docs/([A-Z_]+\.md)\)", README))):
    assert (ROOT / "docs" / page).exists(), page
    assert f": {page}\n" in nav, page
  assert {"GUIDE.md", "BENCHMARKS.md", "FLAX_MODELS.md"} <= set(
      re.findall(r"\(docs/([A-Z_]+\.md)\)", README))
