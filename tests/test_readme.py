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


# README's claims rows -> the titles of the RESULTS.md claims rows they quote (prefixes).
_ASYNC, _MLA = ("HeLoCo beats async DiLoCo (Nesterov, Delayed Nesterov), token budget",
                "HeLoCo beats MLA, wall-clock budget")
_SYNC = "HeLoCo beats synchronous DiLoCo, wall-clock budget, extreme paces"
_QUOTES = [
    [_ASYNC + " |"], [_ASYNC + " — jitter"], [_ASYNC + " — held-out"],
    [_ASYNC + " — each method at its best"], [_ASYNC + " — a 50,257-id"],
    [_MLA + " |"], [_MLA + " — jitter"], [_MLA + " — held-out"],
    [_MLA + " — each method at its best"], [_MLA + " — a 50,257-id"],
    ["HeLoCo beats Delayed Nesterov, token budget, DN at outer lr 1.12"],
    ["HeLoCo beats CGAD, token budget", "HeLoCo beats CGAD, wall-clock budget"],
    [_SYNC + " |", _SYNC + " — jitter", _SYNC + " — held-out", _SYNC + " — each method",
     _SYNC + " — a 50,257-id"],
    ["PALSGD trains faster than DDP (time to DDP's final loss) |"],
    ["PALSGD trains faster than DDP (time to DDP's final loss), at DiLoCo's outer lr 0.7"],
]
_INTERVAL = r"([+−-]\d+\.\d+)% \[([+−-]\d+\.\d+), ([+−-]\d+\.\d+)\]"


def _number(text: str) -> float:
  return float(text.replace("−", "-"))


def test_the_readmes_result_rows_quote_results_md():
  """Issue 60: each claims row of the README says RESULTS.md's verdict and Holm verdict, its
  seed count where it names one, and every 'x% [lo, hi]' it quotes is one of its RESULTS
  rows' cells (RESULTS.md's two decimals) rounded to the README's (regenerating RESULTS.md
  fails this test until the README follows)."""
  results = (ROOT / "experiments" / "RESULTS.md").read_text().split(
      "| claim | paper | rule |", 1)[1].split("\n\n", 1)[0].splitlines()  # the claims table
  table = README.split("| claim | paper | verdict | with Holm |", 1)[1].split("\n\n", 1)[0]
  rows = [[cell.strip() for cell in line.strip("|").split("|")]
          for line in table.strip().splitlines()[1:]]
  assert len(rows) >= len(_QUOTES)
  for (claim, _, verdict, holm), titles in zip(rows, _QUOTES):
    quoted = [line for line in results if any(line.startswith("| " + t) for t in titles)]
    assert len(quoted) == len(titles), (claim, titles)
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in quoted]
    word = re.match(r"(not reproduced|reproduced|partly|reversed)", verdict).group(1)
    assert {c[4].strip("*") for c in cells} == {word}, (claim, [c[4] for c in cells])
    if holm != "–":
      assert {c[5].split(";")[0].strip("*") for c in cells} == {holm.split(" (")[0]}, claim
    if "(5 seeds)" in verdict:
      assert any(c[3].startswith("5 of 5") for c in cells), claim
    windows = [tuple(map(_number, m)) for line in quoted
               for m in re.findall(r"window " + _INTERVAL, line)]
    for text in re.findall(_INTERVAL, verdict):  # within half a unit of its last digit
      halves = [0.5 * 10 ** -len(x.split(".")[1]) + 1e-9 for x in text]  # of RESULTS' value
      want = tuple(_number(x) for x in text)
      assert any(all(abs(w - v) <= h for w, v, h in zip(window, want, halves))
                 for window in windows), (claim, text)
