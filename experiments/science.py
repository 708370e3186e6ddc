"""RESULTS.md of issue 18's grids (``grids.SCIENCE``): the HeLoCo authors' setups, the outer-lr
check and PALSGD over the communication ratio c, from the runs' digests (experiments/results).

Headline numbers follow ALGORITHMS.md: the relative improvement (L_baseline − L_HeLoCo) /
L_baseline of the mean validation loss over seeds, at a fixed token budget and at a fixed
simulated wall-clock budget, here at 25%, 50% and 100% of each budget (those tables stay).

A claim's verdict (``verdict``; the window rule of items 1–4 was committed at ``RULE_COMMIT``
(15f8751, 25 Nov), after issue 18's grids had run (23–24 Nov) and before issue 35's and issue
36's did). The claims table's *rule* column is computed (``rule_label``, issue 81): a row is
``PRE_REGISTERED`` when every run it compares, on both sides (HeLoCo and its baselines, or
PALSGD and DDP) and on every seed it reads, landed after ``RULE_TIME``, the rule's commit time;
a run's date is the commit time of the commit that last added its digest (``digest_dates``:
git log of experiments/results). Otherwise it is ``REJUDGED``, naming how many of its runs
landed before the rule, on which side and when. Without the digests' git history (not a
repository, a shallow clone) a row is ``UNDATED``:

1. Window: HeLoCo's gain over a baseline is read at every evaluation point of
   ``WINDOW_FRACTIONS``, every 5% of the budget from 50% to 100% inclusive (11 points; the
   token table's evaluations fall on them, the time table interpolates at f·T). Per seed, the
   relative gain 100·(L_baseline − L_HeLoCo)/L_baseline at each point is averaged over the 11
   points: the seed's *window gain*. One evaluation's dip or jump then moves it by 1/11.
2. Paired 95% CI over seeds: the seeds both methods have (paired by seed), mean ± t₀.₉₇₅(n−1)
   · s/√n with the sample std s (ddof = 1) of the per-seed window gains and Student's t
   (``t_975``).
3. Each cell (a preset × baseline the claim covers) is *better* when the whole CI is above 0,
   *worse* when the whole CI is below 0, *unclear* otherwise.
4. The claim, over its cells (each with ≥ ``MIN_SEEDS`` paired seeds, else *pending*):
   *reproduced* when every cell is better; *partly* when some but not all cells are better;
   *reversed* when no cell is better and at least one is worse (significantly worse);
   *not reproduced* when every cell is unclear.

Added by issue 60, committed before the runs of ``grids.symmetric_grid`` (seeds 3 and 4) and
after every earlier run, so for those earlier runs they are rules fixed afterwards:

5. Symmetric seeds: a claims row reads the seeds, of those planned for it (``Row``: 0–4 for
   the authors'-setting, jitter and best-lr rows, 0–2 for the held-out and 50,257-id ones),
   that every one of its cells has (``row_seeds``), so all its cells stand on the same n;
   runs of other seeds are listed, not read.
6. Multiplicity (``holm``): beside the verdict, the Holm-corrected one. Each cell's two-sided
   paired t-test p-value (H₀: mean window gain 0; ``paired_p``, the test behind item 2's CI) is
   Holm–Bonferroni adjusted over the row's cells (family = the row's cells, α = ``ALPHA``); a
   cell is better / worse when its adjusted p < α (by the gain's sign), and item 4 maps them.
7. Equivalence (``tost_p``): each severe-paces cell (``TIE_PRESETS``) also gets a paired TOST
   with margin ±``TIE_MARGIN``% on the window gain (two one-sided t-tests, α = ``ALPHA``; its
   p is the larger one): p < α is a *tie*, a finding, not an "unclear". A Holm-unclear cell
   that ties is reported as tie in the Holm-corrected verdict.

Added by issue 81, after every run it judges:

8. Whole-family multiplicity (``judge_family``): beside item 6's verdict, the same p-values
   Holm–Bonferroni adjusted over one family, every cell of every HeLoCo claims row that is
   judged (not pending for want of seeds; the PALSGD rows have no p), α = ``ALPHA``; item 4
   maps a row's cells by their family-adjusted p, and item 7's ties are named as in item 6.

The page's words are ``experiments/RESULTS.template.md`` (``TEMPLATE``): RESULTS.md as it
reads, with a ``string.Template`` placeholder (``$name``, or ``${name}`` when a letter, digit or
underscore follows it; ``$$`` is a literal dollar sign) for each number, table and figure list
this module computes and for each sentence whose wording depends on the numbers
(``write_results``'s fields, all strings). ``render`` fills it in by paragraphs, the blocks
between blank lines (a template paragraph holds no blank line; a field may):

* a paragraph with a placeholder whose field is None (nothing to say yet) is left out;
* a section, from a ``#`` heading to the next, is left out whole when one of its placeholders
  named ``*_table`` is None (no runs for that table yet);
* a sentence that may be missing is a field that starts with its space, or is "".

Every placeholder needs a field and every field a placeholder (``render`` raises otherwise).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import string
import subprocess
import time
from typing import Any, Optional, Sequence

import numpy as np
from scipy import stats

from experiments import analysis, grids
from heloco_jax.runtime import clocks

Result = analysis.Result

# The HeLoCo paper's claims (Al Asif et al. 2026): (name, table, presets, baselines, paper).
CLAIMS = (
    ("HeLoCo beats async DiLoCo (Nesterov, Delayed Nesterov), token budget", "tokens",
     grids.AUTHORS_PRESETS, ("async_nesterov", "delayed_nesterov"), "up to +7.5%"),
    ("HeLoCo beats MLA, wall-clock budget", "time", grids.AUTHORS_PRESETS, ("mla",),
     "up to +3.3%"),
    ("HeLoCo beats synchronous DiLoCo, wall-clock budget, extreme paces", "time", ("severe",),
     ("diloco",), "up to +22.1%"),
    # CGAD (arXiv 2605.09126) came after the paper: its η is tuned here (grids.cgad_grid).
    ("HeLoCo beats CGAD, token budget (CGAD's η tuned here)", "tokens", grids.AUTHORS_PRESETS,
     ("cgad",), "– (after the paper)"),
    ("HeLoCo beats CGAD, wall-clock budget (CGAD's η tuned here)", "time",
     grids.AUTHORS_PRESETS, ("cgad",), "– (after the paper)"),
)
# The authors' final losses in this harness (GPT-2 vocabulary, paces [1,2,3,1,5], tokens).
AUTHORS_FINAL = {"async_nesterov": 7.98, "mla": 7.68, "heloco": 7.60, "diloco": 7.59}


def _authors(results: Sequence[Result]) -> list[Result]:
  return [r for r in results if r.run.name.startswith("authors/")
          and r.run.table in ("tokens", "time")]


def loss_at_time(evals: Sequence[dict[str, Any]], seconds: float,
                 key: str = "val_loss") -> float:
  """Validation loss (``key``: e.g. ``val_loss/de`` for one language) at simulated ``seconds``,
  linear between evaluations; the last evaluation's when the run ended before ``seconds``."""
  times = [e["sim_time"] for e in evals]
  losses = [e[key] for e in evals]
  return float(np.interp(seconds, times, losses))


def loss_at(result: Result, table: str, fraction: float) -> float:
  """``result``'s validation loss at ``fraction`` of its table's budget.

  Token table: the evaluation at that many tokens (evaluations fall on 25/50/100%; the final
  one for 100%). Time table: at ``fraction``·T simulated seconds (``loss_at_time``).
  """
  if table == "tokens":
    if fraction >= 1:
      return result.summary["final_val_loss"]
    target = fraction * dict(result.run.overrides)["budget.tokens"]
    return min(result.evals, key=lambda e: abs(e["tokens"] - target))["val_loss"]
  return loss_at_time(result.evals, fraction * run_time_budget(result.run))


def run_time_budget(run: grids.Run) -> float:
  """T of the run's preset at its own scale: its ``budget.sim_seconds`` (synchronous DiLoCo's
  time runs), else the time in which non-waiting workers read its token budget
  (``grids.time_budget``; the authors grid's T for its runs)."""
  o = dict(run.overrides)
  if o.get("budget.sim_seconds"):
    return float(o["budget.sim_seconds"])
  scale = dataclasses.replace(grids.AUTHORS, tokens=o["budget.tokens"],
                              batch_size=o["batch_size"], context=o["model.context"])
  return grids.time_budget(scale, run.preset, o.get("num_workers", 5))


def runs_for(results: Sequence[Result], table: str, preset: str, method: str) -> list[Result]:
  """The runs of a cell, by seed. The time table's asynchronous runs are the token runs (they
  read the token budget in T), as is homogeneous synchronous DiLoCo's (no one waits).
  Synchronous DiLoCo's token run at any paces is the homogeneous one (``grids.authors_grid``)."""
  own = "time" if table == "time" and method == "diloco" and preset != "homogeneous" else "tokens"
  if own == "tokens" and method == "diloco":
    preset = "homogeneous"
  chosen = [r for r in results if (r.run.table, r.run.preset, r.run.method) == (own, preset,
                                                                                 method)]
  return sorted(chosen, key=lambda r: r.run.seed)


def losses(results, table, preset, method, fraction=1.0) -> dict[int, float]:
  """seed -> validation loss at ``fraction`` of the budget."""
  return {r.run.seed: loss_at(r, table, fraction) for r in runs_for(results, table, preset,
                                                                     method)}


def improvement(results, table, preset, baseline, fraction=1.0,
                seeds: Optional[Sequence[int]] = None) -> Optional[dict[str, Any]]:
  """HeLoCo vs ``baseline`` in one cell: the relative improvement of the means (%), and per
  seed (paired by seed) whether HeLoCo's loss is lower; over ``seeds`` (default: every seed
  both have). None without paired runs."""
  heloco = losses(results, table, preset, "heloco", fraction)
  base = losses(results, table, preset, baseline, fraction)
  seeds = sorted(set(heloco) & set(base) & (set(seeds) if seeds is not None else set(heloco)))
  if not seeds:
    return None
  h, b = np.array([heloco[s] for s in seeds]), np.array([base[s] for s in seeds])
  return {"gain": analysis._improvement(b.mean(), h.mean()),  # pylint: disable=protected-access
          "wins": int(np.sum(h < b)), "seeds": len(seeds),
          "per_seed": [analysis._improvement(x, y) for x, y in zip(b, h)]}  # pylint: disable=protected-access


# The verdict's window (module docstring): every 5% of the budget from 50% to 100%.
WINDOW_FRACTIONS = tuple(round(0.05 * i, 2) for i in range(10, 21))
MIN_SEEDS = 3
# Items 6 and 7 of the rule (module docstring): α of the Holm correction and of the TOST, the
# TOST's margin on the window gain (percentage points of the relative gain) and its presets.
ALPHA = 0.05
TIE_MARGIN = 1.0
TIE_PRESETS = ("severe",)
# The window-sensitivity table's windows (label, fractions): the last evaluation alone, the
# last three quarters, the rule's window, every evaluation after the start.
WINDOWS = (("final point", (1.0,)),
           ("25–100%", tuple(round(0.05 * i, 2) for i in range(5, 21))),
           ("50–100% (the rule)", WINDOW_FRACTIONS),
           ("whole curve (5–100%)", tuple(round(0.05 * i, 2) for i in range(1, 21))))


def t_975(df: int) -> float:
  """Student's t 0.975 quantile with ``df`` degrees of freedom (``scipy.stats.t``)."""
  if df < 1:
    raise ValueError(f"df={df!r} is not allowed; allowed: an integer >= 1")
  return float(stats.t.ppf(0.975, df))


def paired_ci(values: Sequence[float]) -> tuple[float, float, float]:
  """(mean, low, high): the 95% confidence interval of the mean of ``values`` (one per seed,
  already paired differences or gains), t distribution with the sample std (ddof = 1); low and
  high are NaN for fewer than 2 values."""
  x = np.asarray(values, dtype=float)
  if x.size < 2:
    return float(x.mean()) if x.size else math.nan, math.nan, math.nan
  half = t_975(x.size - 1) * float(np.std(x, ddof=1)) / math.sqrt(x.size)
  return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


def category(low: float, high: float) -> str:
  """A cell's category from its paired CI: better (all above 0), worse (all below), unclear."""
  if low > 0:
    return "better"
  if high < 0:
    return "worse"
  return "unclear"


def paired_p(values: Sequence[float]) -> float:
  """The two-sided p-value of the paired t-test of mean 0 over ``values`` (one per seed,
  Student's t with n − 1 degrees of freedom, the test behind ``paired_ci``); NaN for fewer
  than 2 values or none spread."""
  x = np.asarray(values, dtype=float)
  if x.size < 2 or not np.std(x, ddof=1) > 0:
    return math.nan
  t = float(x.mean()) / (float(np.std(x, ddof=1)) / math.sqrt(x.size))
  return float(2 * stats.t.sf(abs(t), x.size - 1))


def tost_p(values: Sequence[float], margin: float = 0.0) -> float:
  """The p-value of the paired TOST for equivalence within ±``margin`` (default
  ``TIE_MARGIN``): the larger of the one-sided t-tests of mean ≤ −margin and mean ≥ +margin
  (Student's t, n − 1 degrees of freedom). p < α iff the (1 − 2α) CI lies inside ±margin.
  NaN for fewer than 2 values or none spread."""
  margin = margin or TIE_MARGIN
  x = np.asarray(values, dtype=float)
  if x.size < 2 or not np.std(x, ddof=1) > 0:
    return math.nan
  se = float(np.std(x, ddof=1)) / math.sqrt(x.size)
  above = stats.t.sf((float(x.mean()) + margin) / se, x.size - 1)  # H0: mean <= -margin
  below = stats.t.cdf((float(x.mean()) - margin) / se, x.size - 1)  # H0: mean >= +margin
  return float(max(above, below))


def holm(pvalues: Sequence[float]) -> list[float]:
  """Holm–Bonferroni adjusted p-values of one family, in the given order: sorted ascending,
  the i-th (from 1) becomes max over j ≤ i of min(1, (m − j + 1)·p_(j)); a hypothesis is
  rejected at α when its adjusted p < α (the step-down procedure). NaN counts as 1."""
  p = np.array([1.0 if not np.isfinite(x) else float(x) for x in pvalues])
  m = p.size
  order = np.argsort(p, kind="stable")
  adjusted = np.empty(m)
  running = 0.0
  for rank, i in enumerate(order):
    running = max(running, min(1.0, (m - rank) * p[i]))
    adjusted[i] = running
  return [float(x) for x in adjusted]


def category_p(p: float, gain: float) -> str:
  """A cell's category from a (Holm-adjusted) two-sided p: better / worse by the gain's sign
  when p < ``ALPHA``, unclear otherwise."""
  if np.isfinite(p) and p < ALPHA:
    return "better" if gain > 0 else "worse"
  return "unclear"


def window_gain(results, table, preset, baseline,
                fractions: Sequence[float] = WINDOW_FRACTIONS,
                seeds: Optional[Sequence[int]] = None) -> Optional[dict[str, Any]]:
  """HeLoCo vs ``baseline`` in one cell over the verdict's window (module docstring): per seed
  (paired; over ``seeds``, default every seed both have), the mean over ``fractions`` of the
  relative gain (%); their mean ``gain``, 95% CI ``low``/``high``, ``category``, the paired
  t-test's ``p`` and the TOST's ``tost_p`` (±``TIE_MARGIN``), ``seeds``, ``seed_list``,
  ``per_seed``, ``preset``, and ``positive_points``: at how many of the window's points the
  mean gain over seeds is above 0. None without paired runs."""
  heloco = [losses(results, table, preset, "heloco", f) for f in fractions]
  base = [losses(results, table, preset, baseline, f) for f in fractions]
  chosen = sorted(set(heloco[-1]) & set(base[-1])
                  & (set(seeds) if seeds is not None else set(heloco[-1])))
  if not chosen:
    return None
  gains = np.array([[analysis._improvement(b[s], h[s]) for s in chosen]  # pylint: disable=protected-access
                    for h, b in zip(heloco, base)])  # points × seeds
  per_seed = gains.mean(axis=0)
  mean, low, high = paired_ci(per_seed)
  return {"gain": mean, "low": low, "high": high, "seeds": len(chosen), "seed_list": chosen,
          "per_seed": [float(g) for g in per_seed], "category": category(low, high),
          "p": paired_p(per_seed), "tost_p": tost_p(per_seed), "preset": preset,
          "positive_points": int(np.sum(gains.mean(axis=1) > 0)), "points": len(fractions)}


def judge_row(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """A claims row's cells with the Holm-adjusted p (``p_holm``, family = the row's cells), the
  category it gives (``holm_category``) and, for ``TIE_PRESETS`` cells, whether the TOST
  shows a tie within ±``TIE_MARGIN``% (``tie``: True / False; None for other presets)."""
  adjusted = holm([c["p"] for c in cells])
  return [{**c, "p_holm": p, "holm_category": category_p(p, c["gain"]),
           "tie": (bool(np.isfinite(c["tost_p"]) and c["tost_p"] < ALPHA)
                   if c["preset"] in TIE_PRESETS else None)}
          for c, p in zip(cells, adjusted)]


def verdict(cells: Sequence[dict[str, Any]], key: str = "category") -> str:
  """reproduced / partly / reversed / not reproduced, from the ``window_gain`` cells a claim
  covers (the rule: module docstring, item 4) by their ``key`` (``holm_category``: the
  Holm-corrected verdict, item 6); pending while a cell has fewer than ``MIN_SEEDS`` paired
  seeds."""
  if not cells:
    return "no runs yet"
  kinds = [c[key] for c in cells]
  if any(c["seeds"] < MIN_SEEDS for c in cells):
    return (f"pending (fewer than {MIN_SEEDS} seeds; significantly better so far in "
            f"{kinds.count('better')} of {len(cells)} comparisons)")
  if all(k == "better" for k in kinds):
    return "**reproduced**"
  if "better" in kinds:
    return "**partly**"
  if "worse" in kinds:
    return "**reversed**"
  return "**not reproduced**"


def holm_verdict(cells: Sequence[dict[str, Any]], label=lambda c: c["preset"],
                 key: str = "holm_category") -> str:
  """The Holm-corrected verdict of ``judge_row``'s cells (``verdict`` by ``key``:
  ``holm_category``, or ``family_category`` of ``judge_family``), naming the cells unclear by
  ``key`` that tie (module docstring, item 7)."""
  text = verdict(cells, key)
  ties = [label(c) for c in cells if c["tie"] and c[key] == "unclear"]
  if ties and not text.startswith(("pending", "no runs")):
    text += f"; tie within ±{TIE_MARGIN:g}%: {', '.join(ties)}"
  return text


def judge_family(rows: Sequence[Sequence[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
  """Each row's ``judge_row`` cells with the whole-family Holm-adjusted p (``p_family``) and
  its category (``family_category``; module docstring, item 8): one family of every cell of
  the rows that are judged (``verdict`` not pending, not empty); the other rows' cells get
  NaN and "unclear"."""
  judged = [bool(cells) and all(c["seeds"] >= MIN_SEEDS for c in cells) for cells in rows]
  adjusted = iter(holm([c["p"] for cells, j in zip(rows, judged) if j for c in cells]))
  out = []
  for cells, j in zip(rows, judged):
    ps = [next(adjusted) if j else math.nan for _ in cells]
    out.append([{**c, "p_family": p, "family_category": category_p(p, c["gain"])}
                for c, p in zip(cells, ps)])
  return out


def family_changes(results: Sequence[Result]) -> tuple[int, int, int]:
  """(cells, rows, rows whose verdict differs): ``judge_family``'s family of the claims
  table's HeLoCo rows, and in how many of its rows the whole-family Holm verdict is not the
  per-row one."""
  rows = judge_family([row.cells()[0] for row in heloco_rows(results)])
  size, judged = family_size(rows)
  changed = sum(verdict(cells, "holm_category") != verdict(cells, "family_category")
                for cells in rows if cells and "pending" not in verdict(cells))
  return size, judged, changed


def family_size(rows: Sequence[Sequence[dict[str, Any]]]) -> tuple[int, int]:
  """(cells, rows) of ``judge_family``'s family among ``rows``."""
  judged = [cells for cells in rows if cells and all(c["seeds"] >= MIN_SEEDS for c in cells)]
  return sum(map(len, judged)), len(judged)


# Whether a row's rule predates its runs (module docstring, ``rule_label``): the window rule's
# commit, 15f8751, and its commit time (2026-11-25 00:25:28 UTC; a test reads it from git).
RULE_COMMIT = "15f8751"
RULE_TIME = 1795566328
PRE_REGISTERED = "pre-registered (rule 15f8751 before these runs)"
REJUDGED = "re-judged with the rule fixed afterwards"  # rule_label says which runs
UNDATED = "not dated (no git history of the digests here)"


def digest_dates(results_dir: str) -> Optional[dict[str, float]]:
  """Digest name (its path under ``results_dir`` without ``.json``) -> the Unix time of the
  commit that last added or changed it (git log); a digest not committed yet (untracked or
  changed): now. None when git cannot date them: no git, not a repository, a shallow clone,
  or ``RULE_COMMIT`` not in the history."""
  def git(*args: str) -> str:
    return subprocess.run(["git", "-C", results_dir, *args], capture_output=True, text=True,
                          check=True).stdout
  try:
    if git("rev-parse", "--is-shallow-repository").strip() != "false":
      return None
    git("cat-file", "-e", f"{RULE_COMMIT}^{{commit}}")
    log = git("log", "--relative", "--diff-filter=AM", "--format=@%ct", "--name-only", "--",
              ".")
    pending = git("ls-files", "--others", "--modified", "--exclude-standard", "--", ".")
  except (OSError, subprocess.CalledProcessError):
    return None
  dates: dict[str, float] = {}
  when = 0.0
  for line in log.splitlines():
    if line.startswith("@"):
      when = float(line[1:])
    elif line.endswith(".json"):
      dates.setdefault(line.removesuffix(".json"), when)  # newest first: the last add
  now = time.time()
  dates.update({line.removesuffix(".json"): now for line in pending.splitlines()
                if line.endswith(".json")})
  return dates


def _day(when: float) -> tuple[int, str]:
  day = time.gmtime(when)
  return day.tm_mday, time.strftime("%b", day)


def _span(times: Sequence[float]) -> str:
  """The UTC days of ``times``: "23 Nov", "23–24 Nov" or "30 Nov–1 Dec"."""
  (d0, m0), (d1, m1) = _day(min(times)), _day(max(times))
  if (d0, m0) == (d1, m1):
    return f"{d0} {m0}"
  return f"{d0}–{d1} {m1}" if m0 == m1 else f"{d0} {m0}–{d1} {m1}"


def rule_label(sides: dict[str, Sequence[str]],
               dates: Optional[dict[str, float]]) -> str:
  """The *rule* column of a row that compares ``sides`` (side -> the digests of its runs,
  ``Result.origin``) by the runs' ``dates`` (``digest_dates``): ``PRE_REGISTERED`` when every
  run landed after ``RULE_TIME``; else ``REJUDGED`` with how many runs landed before it, on
  which side and on which days; ``UNDATED`` without dates for every run."""
  names = sorted({n for ns in sides.values() for n in ns})
  if dates is None or not names or any(n not in dates for n in names):
    return UNDATED
  before = {side: sorted({n for n in ns if dates[n] < RULE_TIME}) for side, ns in sides.items()}
  early = sorted({n for ns in before.values() for n in ns})
  if not early:
    return PRE_REGISTERED
  which = ("both sides" if all(before.values()) else
           " and ".join(side for side, ns in before.items() if ns) + " side")
  return (f"{REJUDGED} ({len(early)} of {len(names)} runs, {which}, landed "
          f"{_span([dates[n] for n in early])}, before rule {RULE_COMMIT} of "
          f"{_span([RULE_TIME])})")


class Row:
  """A HeLoCo claims row: the claim on one set of runs (relabelled as the authors grid's),
  its cells (``presets`` × ``baselines`` of ``table``), how its cells are named and the seeds
  every cell is planned to have (the only ones it reads)."""

  def __init__(self, name: str, paper: str, runs: Sequence[Result], table: str,
               presets: Sequence[str], baselines: Sequence[str],
               planned_seeds: Sequence[int], label=None, extra: Sequence[str] = ()):
    self.name, self.paper, self.runs, self.table = name, paper, list(runs), table
    self.presets, self.baselines = tuple(presets), tuple(baselines)
    self.planned_seeds = tuple(planned_seeds)
    self.label, self.extra = label or _cell_label, list(extra)

  def cells(self, fractions: Sequence[float] = WINDOW_FRACTIONS
            ) -> tuple[list[dict[str, Any]], list[str]]:
    return _claim_cells(self.runs, self.table, self.presets, self.baselines, self.label,
                        fractions, self.planned_seeds)

  def sides(self) -> dict[str, list[str]]:
    """"HeLoCo's" and "the baseline's" (or "the baselines'") -> the digests
    (``Result.origin``) of the runs the row's cells compare: each cell's runs of that side on
    the seeds it reads (``row_seeds``) that both sides have."""
    seeds = set(row_seeds(self.runs, self.table, self.presets, self.baselines,
                          self.planned_seeds))
    other = "the baseline's" if len(self.baselines) == 1 else "the baselines'"
    sides: dict[str, set[str]] = {"HeLoCo's": set(), other: set()}
    for preset in self.presets:
      for baseline in self.baselines:
        paired = seeds & set(_paired_seeds(self.runs, self.table, preset, baseline))
        for side, method in (("HeLoCo's", "heloco"), (other, baseline)):
          sides[side].update(r.origin for r in runs_for(self.runs, self.table, preset, method)
                             if r.run.seed in paired)
    return {side: sorted(names) for side, names in sides.items()}


def authors_planned_seeds() -> tuple[int, ...]:
  """Seeds every cell of the authors'-setting, jitter and best-lr rows is planned to have:
  the grids' 0, 1, 2 and ``grids.SYMMETRIC_SEEDS`` (issue 60)."""
  return (*grids.AUTHORS.seeds, *grids.SYMMETRIC_SEEDS)


def heloco_rows(results: Sequence[Result]) -> list[Row]:
  """Every HeLoCo claims row that has runs: ``CLAIMS`` on the authors grid (the synchronous
  one with the decay_why runs' gains beside it), Delayed Nesterov at its lr tuned on mixed
  paces, then ``VARIANTS`` and each method at its best outer lr (``variant_rows``)."""
  authors = _authors(results)
  rows = []
  for name, table, presets, baselines, paper in CLAIMS:
    extra = []
    if (presets, baselines) == ((grids.DECAY_WHY_PRESET,), ("diloco",)) and any(
        r.run.table in grids.DECAY_WHY_VARIANTS for r in results):
      extra = [f"inner lr {label} (not their setting): {c['gain']:+.2f}% ({c['wins']}/"
               f"{c['seeds']})" for label, c in list(heloco_vs_sync_by_decay(results).items())[1:]]
    rows.append(Row(name, paper, authors, table, presets, baselines, authors_planned_seeds(),
                    extra=extra))
  tuned = dn_tuned_results(results)
  if tuned:
    rows.append(Row(
        f"HeLoCo beats Delayed Nesterov, token budget, DN at outer lr "
        f"{grids.dn_tuned_learning_rate():g} (× {grids.DN_TUNED_FACTOR:g} the authors'), the "
        f"best of its check on mixed paces, seed 0 (with jitter its best at severe and moderate "
        f"paces is × 8: the best-lr rows); not their setting", "up to +7.5%", tuned, "tokens",
        grids.AUTHORS_PRESETS, ("delayed_nesterov",), authors_planned_seeds(),
        label=lambda preset, baseline: preset))
  return rows + variant_rows(results)


def _seeds_text(cells: Sequence[dict[str, Any]], available: dict[str, list[int]],
                planned: Sequence[int]) -> str:
  """The seeds column: n of the planned per cell, and the seeds some cells have but the row
  does not read (module docstring, item 5)."""
  used = cells[0]["seeds"] if cells else 0
  text = f"{used} of {len(planned)}"
  unread = {label: [s for s in seeds if s not in cells[0]["seed_list"]]
            for label, seeds in available.items()} if cells else {}
  groups: dict[tuple[int, ...], int] = {}  # the unread seeds -> how many cells have them
  for seeds in unread.values():
    if seeds:
      groups[tuple(seeds)] = groups.get(tuple(seeds), 0) + 1
  if groups:
    text += " (not read: " + "; ".join(
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} of {n} "
        f"cell{'s' if n > 1 else ''}" for seeds, n in sorted(groups.items())) + ")"
  return text


def _tost_text(cells: Sequence[dict[str, Any]], label) -> str:
  """The TOST column: each ``TIE_PRESETS`` cell's finding and p."""
  parts = [f"{label(c)}: {'**tie**' if c['tie'] else 'no tie shown'} (p {_p(c['tost_p'])})"
           for c in cells if c["tie"] is not None]
  return "; ".join(parts) or "–"


def claims_table(results: Sequence[Result], dates: Optional[dict[str, float]] = None) -> str:
  """Markdown: each claim, when its rule was fixed against its runs (``rule_label`` by
  ``dates``, ``digest_dates``), its verdict, Holm-corrected verdict over the row and over the
  whole family, the severe cells' TOST and the measured magnitude over the window and at
  25/50/100% of the budget."""
  rows = [(row, *row.cells()) for row in heloco_rows(results)]
  rows = [(row, cells) for row, cells, _ in rows if cells]
  judged = judge_family([cells for _, cells in rows])
  size, judged_rows = family_size([cells for _, cells in rows])
  lines = claims_header(f"all {size} cells of the {judged_rows} HeLoCo rows judged")
  lines += [claims_line(row, cells, dates) for (row, _), cells in zip(rows, judged)]
  for method, setting in (("palsgd", ""), (grids.PALSGD_SWAPPED, ", at DiLoCo's outer lr 0.7 "
                                           "instead of the authors' 0.1 (not their setting)")):
    speedup = palsgd_claim(results, method)
    if speedup:
      rule = rule_label(palsgd_sides(results, method), dates)
      lines.append(f"| PALSGD trains faster than DDP (time to DDP's final loss){setting} | "
                   f"21.1–24.4% faster | {rule} | {_palsgd_seeds(results, method)} | "
                   f"{speedup[0]} | – | – | – | {speedup[1]} |")
  tuned = fair_ddp(results)
  if tuned:
    fair = [("palsgd", "", None), (grids.PALSGD_SWAPPED, ", PALSGD at outer lr 0.7", None)]
    if grids.PALSGD_FAIR_BEST:
      lr, pull = grids.PALSGD_FAIR_BEST
      fair.append((grids.palsgd_fair_name(lr, pull), f", PALSGD at its best outer lr {lr:g} "
                   f"and pull {pull:g} (swept at c = {grids.PALSGD_WHY_C:g} only)",
                   (grids.PALSGD_WHY_C,)))
    for method, setting, cs in fair:
      speedup = palsgd_claim(results, method, tuned[0], cs)
      if speedup:
        rule = rule_label(palsgd_sides(results, method, tuned[0], cs), dates)
        lines.append(
            f"| PALSGD trains faster than DDP (time to DDP's final loss), DDP tuned for its own "
            f"run (inner lr × {tuned[1]:.3g}, its decay over its own "
            f"{grids.ddp_own_steps():,} steps){setting}; not their setting | 21.1–24.4% "
            f"faster | {rule} | {_palsgd_seeds(results, method, tuned[0])} | "
            f"{speedup[0]} | – | – | – | {speedup[1]} |")
  if line := palsgd8m_claim(results, dates):
    lines.append(line)
  return "\n".join(lines)


def claims_header(family: str, gain: str = "HeLoCo's gain, mean over seeds, per preset and "
                  "baseline") -> list[str]:
  """The claims table's header lines; ``family``: the cells of the whole-family Holm
  correction (``judge_family``), ``gain``: whose gain the last column gives."""
  return ["| claim | paper | rule | seeds per cell (of planned) | verdict (window 50–100% of "
          "the budget, paired 95% CIs) | Holm-corrected verdict (α 0.05, family: the row's "
          f"cells) | whole-family Holm verdict (α 0.05, family: {family}) | severe cells: TOST "
          f"±{TIE_MARGIN:g}% | {gain}: over the window [95% CI], its category, p (paired t), "
          "Holm-adjusted p over the row and over the whole family; at 25% / 50% / 100% of the "
          "budget (wins/seeds at 100%) |", "|---|---|---|---|---|---|---|---|---|"]


def claims_line(row: "Row", cells: Sequence[dict[str, Any]],
                dates: Optional[dict[str, float]] = None) -> str:
  """A claims table's line of ``row``: its ``judge_family`` cells' verdicts, the rule column
  (``rule_label`` by ``dates``), seeds, TOST and per-cell numbers (``claims_header``)."""
  named = lambda c: row.label(c["preset"], c["baseline"])
  text = [_cell_text(c, row.label) for c in cells]
  return (f"| {row.name} | {row.paper} | {rule_label(row.sides(), dates)} | "
          f"{_seeds_text(cells, _available_seeds(row), row.planned_seeds)} | {verdict(cells)} | "
          f"{holm_verdict(cells, named)} | {holm_verdict(cells, named, 'family_category')} | "
          f"{_tost_text(cells, named)} | {'; '.join(text + row.extra)} |")


def palsgd_sides(results: Sequence[Result], method: str, ddp_name: Optional[str] = None,
                 cs: Optional[Sequence[float]] = None) -> dict[str, list[str]]:
  """"PALSGD's" and "DDP's" -> the digests of the runs ``palsgd_claim`` compares: at each c of
  ``cs`` (default: every c DDP ran at), ``method``'s runs and DDP's (the palsgd_c grid's, or
  the palsgd_fair variant ``ddp_name``) on the seeds both have."""
  sides: dict[str, set[str]] = {"PALSGD's": set(), "DDP's": set()}
  for c in grids.COMM_RATIOS if cs is None else cs:
    ddp = (_fair_runs(results, c, ddp_name) if ddp_name else _palsgd_runs(results, c, "ddp"))
    own = {**_palsgd_runs(results, c, method), **_fair_runs(results, c, method)}
    for seed in set(ddp) & set(own):
      sides["PALSGD's"].add(own[seed].origin)
      sides["DDP's"].add(ddp[seed].origin)
  return {side: sorted(names) for side, names in sides.items()}


def _palsgd_seeds(results: Sequence[Result], method: str, ddp_name: Optional[str] = None) -> str:
  """The seeds column of a PALSGD row: the fewest seeds ``method`` has at a c it ran at."""
  counts = [len(t[method]) for t in palsgd_times(results, ddp_name).values() if t.get(method)]
  return f"{min(counts)} per c" if counts else "–"


def palsgd_fair_table(results: Sequence[Result]) -> str:
  """Markdown: DDP at each inner lr factor with its own decay (final loss), then PALSGD at
  each outer lr × pull at c = ``grids.PALSGD_WHY_C`` (the authors' and the 0.7 run from
  palsgd_c among them): final loss and time to the tuned DDP's final loss."""
  tuned = fair_ddp(results)
  ddp_rows = []
  for f in grids.DDP_FAIR_LR_FACTORS:
    runs = _fair_runs(results, 0.0, grids.ddp_fair_name(f))
    if runs:
      ddp_rows.append(f"| DDP, inner lr × {f:.3g}, decay over {grids.ddp_own_steps():,} steps"
                      f"{' (tuned)' if tuned and tuned[1] == f else ''} | – | "
                      f"{_final_losses(runs)} | – | – | {len(runs)} |")
  if not ddp_rows:
    return ""
  plain = _palsgd_runs(results, 0.0, "ddp")
  lines = [f"| run | pull | final val loss | time to the tuned DDP's loss at c = "
           f"{grids.PALSGD_WHY_C:g}, s | vs the tuned DDP | seeds |",
           "|---|---|---|---|---|---|", *ddp_rows]
  if plain:
    lines.append(f"| DDP as in palsgd_c (decay over 4,000 steps) | – | {_final_losses(plain)} "
                 f"| – | – | {len(plain)} |")
  t = palsgd_times(results, tuned[0]).get(grids.PALSGD_WHY_C) if tuned else None
  variants = [(grids.PALSGD_OUTER_LR, grids.PALSGD_PULL, "palsgd"),
              (0.7, grids.PALSGD_PULL, grids.PALSGD_SWAPPED)] + [
                  (lr, pull, grids.palsgd_fair_name(lr, pull))
                  for lr, pull in grids.palsgd_fair_sweep()]
  for lr, pull, name in sorted(set(variants)):
    runs = (_palsgd_runs if name in ("palsgd", grids.PALSGD_SWAPPED) else _fair_runs)(
        results, grids.PALSGD_WHY_C, name)
    if not runs:
      continue
    times = list(t.get(name, {}).values()) if t else []
    reached = bool(times) and bool(np.all(np.isfinite(times)))
    lines.append(f"| PALSGD, outer lr {lr:g} | {pull:g} | {_final_losses(runs)} | "
                 + (f"{np.mean(times):,.0f}"
                    + (f" ({len(times)} of the seeds)" if len(times) < len(runs) else "")
                    + f" | {_gain(t, 'ddp', name):+.1f}%" if reached else
                    f"not reached on {sum(~np.isfinite(times))} of {len(times)} seeds | –"
                    if times else "– | –") + f" | {len(runs)} |")
  return "\n".join(lines)


def _palsgd8m_runs(results: Sequence[Result], name: str) -> dict[int, Result]:
  """Seed -> the palsgd8m grid's run ``name`` (``grids.palsgd8m_grid``)."""
  table = f"palsgd8m/c{grids.PALSGD8M_C:g}"
  return {r.run.seed: r for r in results if r.run.table == table and r.run.method == name}


def _censored_time(run: Result, target: float) -> float:
  """Simulated seconds to ``target`` (``analysis.time_to_loss``); the run's end where it never
  gets there (a bound in the run's favour: it would need longer)."""
  t = analysis.time_to_loss(run.evals, target)
  return t if np.isfinite(t) else float(run.evals[-1]["sim_time"])


def palsgd8m_picks(results: Sequence[Result]
                   ) -> tuple[Optional[float], Optional[tuple[float, float]]]:
  """(DDP's inner lr factor, PALSGD's (outer lr, pull)) picked by the palsgd8m rule
  (``grids.palsgd8m_grid``'s comment) on the tuning seeds ``grids.PALSGD8M.seeds``: DDP's
  lowest mean final validation loss; PALSGD's shortest mean time to each seed's tuned-DDP
  final loss (inf where a seed never reaches it; then the lower mean final loss). None for a
  side whose tuning runs have not all landed."""
  tuning = grids.PALSGD8M.seeds
  final = lambda runs: float(np.mean([runs[s].summary["final_val_loss"] for s in tuning]))
  ddp = {f: _palsgd8m_runs(results, grids.ddp_fair_name(f)) for f in grids.PALSGD8M_DDP_FACTORS}
  if not all(set(tuning) <= set(runs) for runs in ddp.values()):
    return None, None
  factor = min(ddp, key=lambda f: final(ddp[f]))
  palsgd = {c: _palsgd8m_runs(results, grids.palsgd_fair_name(*c))
            for c in grids.PALSGD8M_CANDIDATES}
  if not all(set(tuning) <= set(runs) for runs in palsgd.values()):
    return factor, None
  target = {s: analysis.target_loss(ddp[factor][s]) for s in tuning}
  time = lambda runs: float(np.mean([analysis.time_to_loss(runs[s].evals, target[s])
                                     for s in tuning]))
  return factor, min(palsgd, key=lambda c: (time(palsgd[c]), final(palsgd[c])))


def palsgd8m_speedups(results: Sequence[Result], picks: Optional[tuple[
    Optional[float], Optional[tuple[float, float]]]] = None) -> dict[int, float]:
  """Seed -> PALSGD's speedup over DDP in % ((t_DDP − t_PALSGD) / t_DDP, t: simulated seconds
  to that seed's DDP final loss, PALSGD's censored at its end), both at their picks
  (``picks``; default ``palsgd8m_picks``), on every seed both have."""
  factor, best = picks or palsgd8m_picks(results)
  if best is None:
    return {}
  ddp = _palsgd8m_runs(results, grids.ddp_fair_name(factor))
  palsgd = _palsgd8m_runs(results, grids.palsgd_fair_name(*best))
  out = {}
  for seed in sorted(set(ddp) & set(palsgd)):
    target = analysis.target_loss(ddp[seed])
    t_ddp = analysis.time_to_loss(ddp[seed].evals, target)
    out[seed] = 100 * (t_ddp - _censored_time(palsgd[seed], target)) / t_ddp
  return out


def palsgd8m_claim(results: Sequence[Result], dates: Optional[dict[str, float]] = None
                   ) -> Optional[str]:
  """The claims table's line of PALSGD vs DDP at ≈8M parameters: the paired speedups over
  the seeds (``palsgd8m_speedups``), their 95% CI, category and verdict (the HeLoCo rows'
  rule, module docstring); None until both picks are known."""
  picks = palsgd8m_picks(results)
  speedups = palsgd8m_speedups(results, picks)
  if not speedups:
    return None
  factor, (lr, pull) = picks
  mean, low, high = paired_ci(list(speedups.values()))
  cell = {"seeds": len(speedups), "category": category(low, high)}
  names = (grids.ddp_fair_name(factor), grids.palsgd_fair_name(lr, pull))
  sides = {side: sorted(_palsgd8m_runs(results, name)[s].origin for s in speedups)
           for side, name in zip(("DDP's", "PALSGD's"), names)}
  interval = f"[{low:+.1f}, {high:+.1f}]" if np.isfinite(low) else "[no CI: 1 seed]"
  per_seed = ", ".join(f"seed {s}: {v:+.1f}%" for s, v in speedups.items())
  return (f"| PALSGD trains faster than DDP (time to DDP's final loss) at ≈8M parameters (the "
          f"body model, {grids.scale_params(grids.PALSGD8M) / 1e6:.1f}M; c = "
          f"{grids.PALSGD8M_C:g}), both tuned on seeds "
          f"{', '.join(map(str, grids.PALSGD8M.seeds))} (DDP inner lr × {factor:.3g}, PALSGD "
          f"outer lr {lr:g}, pull {pull:g}) | 21.1% faster (GPT-Neo-8M) | "
          f"{rule_label(sides, dates)} | {len(speedups)} of "
          f"{len(grids.PALSGD8M.seeds) + len(grids.PALSGD8M_MORE_SEEDS)} | {verdict([cell])} | "
          f"– | – | – | speedup {mean:+.1f}% {interval}, {cell['category']}, p "
          f"{_p(paired_p(list(speedups.values())))}; {per_seed} |")


def palsgd8m_table(results: Sequence[Result]) -> str:
  """Markdown: the palsgd8m grid's candidates (final loss; PALSGD's time to the tuned DDP's
  loss on the tuning seeds), the picks marked (DDP's as an edge where it is the lowest or the
  highest factor: a tuning that may not have found DDP's best); "" without runs."""
  factor, best = palsgd8m_picks(results)
  factors = grids.PALSGD8M_DDP_FACTORS
  lines = []
  for f in factors:
    runs = _palsgd8m_runs(results, grids.ddp_fair_name(f))
    mark = ("" if f != factor else " (pick, the candidates' edge)"
            if f in (min(factors), max(factors)) else " (pick)")
    if runs:
      lines.append(f"| DDP, inner lr × {f:.3g}{mark} | {_final_losses(runs)} | – | "
                   f"{len(runs)} |")
  target = ({s: analysis.target_loss(r)
             for s, r in _palsgd8m_runs(results, grids.ddp_fair_name(factor)).items()}
            if factor is not None else {})
  for lr, pull in grids.PALSGD8M_CANDIDATES:
    runs = _palsgd8m_runs(results, grids.palsgd_fair_name(lr, pull))
    if not runs:
      continue
    times = [analysis.time_to_loss(runs[s].evals, target[s]) for s in sorted(runs)
             if s in target]
    reached = [t for t in times if np.isfinite(t)]
    text = ("–" if not times else f"{np.mean(reached):,.0f} ({len(reached)} of {len(times)} "
            "seeds reach it)" if reached else f"not reached on {len(times)} of {len(times)} seeds")
    lines.append(f"| PALSGD, outer lr {lr:g}, pull {pull:g}"
                 f"{' (pick)' if (lr, pull) == best else ''} | {_final_losses(runs)} | {text} | "
                 f"{len(runs)} |")
  if not lines:
    return ""
  return "\n".join(["| run | final val loss | time to the tuned DDP's final loss, s | seeds |",
                    "|---|---|---|---|", *lines])


def _final_losses(runs: dict[int, Result]) -> str:
  """The final validation losses of ``runs`` (seed -> run): mean ± sample std, 4 digits."""
  return analysis.mean_std([r.summary["final_val_loss"] for r in runs.values()], 4)


def _cell_label(preset: str, baseline: str) -> str:
  return f"{preset} vs {baseline}"


def _p(p: float) -> str:
  """A p-value as RESULTS.md prints it: 3 decimals, "<0.001" below, "–" for none."""
  if not np.isfinite(p):
    return "–"
  return "<0.001" if p < 0.001 else f"{p:.3f}"


def _paired_seeds(results: Sequence[Result], table: str, preset: str, baseline: str) -> list[int]:
  """The seeds on which HeLoCo and ``baseline`` both have a run in one cell."""
  return sorted(set(losses(results, table, preset, "heloco"))
                & set(losses(results, table, preset, baseline)))


def row_seeds(results: Sequence[Result], table: str, presets: Sequence[str],
              baselines: Sequence[str], planned: Optional[Sequence[int]] = None) -> list[int]:
  """The seeds a claims row reads (module docstring, item 5): those of ``planned`` (default:
  any) that every cell with runs has."""
  found = [set(_paired_seeds(results, table, p, b)) for p in presets for b in baselines]
  found = [f for f in found if f]
  seeds = set.intersection(*found) if found else set()
  return sorted(seeds & set(planned) if planned is not None else seeds)


def _available_seeds(row: "Row") -> dict[str, list[int]]:
  """Cell label -> the paired seeds it has, for the cells of ``row`` with runs."""
  out = {}
  for preset in row.presets:
    for baseline in row.baselines:
      seeds = _paired_seeds(row.runs, row.table, preset, baseline)
      if seeds:
        out[row.label(preset, baseline)] = seeds
  return out


def _claim_cells(results: Sequence[Result], table: str, presets: Sequence[str],
                 baselines: Sequence[str], label=_cell_label,
                 fractions: Sequence[float] = WINDOW_FRACTIONS,
                 planned: Optional[Sequence[int]] = None
                 ) -> tuple[list[dict[str, Any]], list[str]]:
  """A claims row's cells (``window_gain`` over ``fractions`` on the row's seeds,
  ``row_seeds`` of ``planned``, then ``judge_row``: for ``verdict`` and ``holm_verdict``) and
  its text: per preset and baseline, the window gain with its paired 95% CI, category, p and
  Holm-adjusted p, then HeLoCo's gain at each of ``grids.BUDGET_FRACTIONS`` (wins/seeds at 100%)."""
  seeds = row_seeds(results, table, presets, baselines, planned)
  cells, budget_points = [], []
  for preset in presets:
    for baseline in baselines:
      at = [improvement(results, table, preset, baseline, f, seeds)
            for f in grids.BUDGET_FRACTIONS]
      window = window_gain(results, table, preset, baseline, fractions, seeds)
      if at[-1] is None or window is None:
        continue
      cells.append({**window, "baseline": baseline})
      budget_points.append(at)
  cells = [{**c, "budget_points": at} for c, at in zip(judge_row(cells), budget_points)]
  return cells, [_cell_text(c, label) for c in cells]


def _cell_text(cell: dict[str, Any], label=_cell_label) -> str:
  """A cell of the claims table's last column: the window gain, its CI, category, p, Holm p
  (and the whole-family Holm p once ``judge_family`` has given one), then the gains at
  ``grids.BUDGET_FRACTIONS`` (wins/seeds at 100%)."""
  ci = (f"[{cell['low']:+.2f}, {cell['high']:+.2f}]" if math.isfinite(cell["low"])
        else "[no CI: 1 seed]")
  at = cell["budget_points"]
  gains = " / ".join(f"{a['gain']:+.2f}%" for a in at)
  family = f", family Holm p {_p(cell['p_family'])}" if "p_family" in cell else ""
  return (f"{label(cell['preset'], cell['baseline'])}: window {cell['gain']:+.2f}% {ci} "
          f"{cell['category']}, p {_p(cell['p'])}, Holm p {_p(cell['p_holm'])}{family}; {gains} "
          f"({at[-1]['wins']}/{at[-1]['seeds']})")


def dn_tuned_results(results: Sequence[Result]) -> list[Result]:
  """The authors grid's runs with Delayed Nesterov's token runs replaced by the ``dn_tuned``
  grid's (its best outer lr here), so that ``improvement`` compares HeLoCo against those; empty
  without ``dn_tuned`` runs."""
  tuned = [dataclasses.replace(r, run=dataclasses.replace(r.run, table="tokens"))
           for r in results if r.run.table == "dn_tuned"]
  if not tuned:
    return []
  return [r for r in _authors(results) if r.run.method != "delayed_nesterov"] + tuned


# Issue 36's grids (and issue 60's scale grid) as variants of the claims: (run name kind,
# label, the runs' name prefix, seeds planned per cell). Each variant's runs are relabelled as
# the authors grid's (``variant_results``) and judged with the same rule.
VARIANTS = (
    ("jitter", f"jitter {grids.JITTER:g}: each seed its own arrival schedule", None,
     (*grids.AUTHORS.seeds, *grids.SYMMETRIC_SEEDS)),
    (f"vocab{grids.VOCAB_50K}", f"a {grids.VOCAB_50K:,}-id BPE (the authors' size)", None,
     grids.AUTHORS.seeds),
    ("heldout", f"held-out languages {grids.HELDOUT_LANGUAGES.replace(',', ', ')}, jitter "
                f"{grids.JITTER:g}", None, grids.AUTHORS.seeds),
    ("scale", f"scale: d_model {grids.SCALE.d_model}, {grids.SCALE.num_layers} layers, "
              f"{grids.scale_params() / 1e6:.1f}M parameters, {grids.SCALE.tokens / 1e6:.1f}M "
              f"tokens (each language read 5-6 times), jitter {grids.JITTER:g} (GPU)",
     grids.SCALE_PREFIX, grids.SCALE.seeds),
    ("body", f"body 4×: d_model {grids.BODY.d_model}, {grids.BODY.num_layers} layers, "
             f"{grids.scale_params(grids.BODY) / 1e6:.1f}M parameters, "
             f"{grids.BODY.tokens / 1e6:.2f}M tokens, jitter {grids.JITTER:g} (CPU)",
     grids.BODY_PREFIX, (*grids.BODY.seeds, *grids.BODY_MORE_SEEDS)),
)


def _as_authors(result: Result, name: str, table: str) -> Result:
  return dataclasses.replace(result, run=dataclasses.replace(result.run, name=name, table=table),
                             source=result.origin)


def variant_results(results: Sequence[Result], kind: str,
                    prefix: Optional[str] = None) -> list[Result]:
  """The runs ``<prefix><table>/...`` (default prefix ``skeptic/<kind>/``) as the authors
  grid's (``authors/<table>/...``, table ``tokens`` or ``time``), so that ``improvement``,
  ``window_gain`` and the claims read them."""
  prefix = prefix or f"skeptic/{kind}/"
  return [_as_authors(r, r.run.name.replace(prefix, "authors/", 1), r.run.table.split("/")[-1])
          for r in results if r.run.name.startswith(prefix)]


def window_loss(result: Result, table: str) -> float:
  """A run's validation loss averaged over ``WINDOW_FRACTIONS`` of its table's budget."""
  return float(np.mean([loss_at(result, table, f) for f in WINDOW_FRACTIONS]))


def _lr_sweeps(results: Sequence[Result]
               ) -> dict[tuple[str, str], tuple[dict[float, list[Result]], dict[float, float],
                                                float]]:
  """(preset, method) -> (factor of its outer lr -> runs, factor -> seed 0's ``window_loss``,
  the best factor): ``grids.lr_sweep_grid``'s runs and, as × 1, the ``jitter`` runs, for the
  cells whose seed 0 has a swept factor (seed 0 is the seed the whole sweep runs on)."""
  by_cell: dict[tuple[str, str], dict[float, list[Result]]] = {}
  for r in results:
    if r.run.name.startswith("skeptic/lr/"):
      factor = float(r.run.name.split("/")[-2][1:])
    elif r.run.name.startswith("skeptic/jitter/"):
      factor = 1.0
    else:
      continue
    by_cell.setdefault((r.run.preset, r.run.method), {}).setdefault(factor, []).append(r)
  sweeps = {}
  for cell, factors in sorted(by_cell.items()):
    loss = {f: window_loss(r, r.run.table.split("/")[-1])
            for f, runs in factors.items() for r in runs if r.run.seed == 0}
    if any(f != 1.0 for f in loss):
      sweeps[cell] = (factors, loss, min((f for f in loss if np.isfinite(loss[f])),
                                         key=loss.get))
  return sweeps


def best_lr_results(results: Sequence[Result]) -> tuple[list[Result], dict[tuple[str, str],
                                                                            float]]:
  """Each method at its best outer lr per preset (``grids.lr_sweep_grid`` and its × 1, the
  ``jitter`` runs), as the authors grid's runs; and (preset, method) -> the chosen factor.

  The best: the lowest ``window_loss`` on seed 0, the seed the whole sweep runs on (the other
  seeds run at that factor only, ``grids.SKEPTIC_LR_BEST``). Seed 0 then also judges the
  claims, so the choice favours each method a little on it (HeLoCo as much as the baselines).
  """
  chosen, out = {}, []
  for (preset, method), (factors, _, best) in _lr_sweeps(results).items():
    chosen[(preset, method)] = best
    for r in factors[best]:
      table = r.run.table.split("/")[-1]
      out.append(_as_authors(r, f"authors/{table}/{preset}/{method}/seed{r.run.seed}", table))
  return out, chosen


def skeptic_lr_table(results: Sequence[Result]) -> str:
  """Markdown: the per-preset outer-lr sweep (``grids.lr_sweep_grid``), seed 0's window loss
  at each factor, the best in bold and whether a factor on each side of it was run."""
  sweeps = _lr_sweeps(results)
  if not sweeps:
    return ""
  factors = sorted(set(itertools.chain(*(loss for _, loss, _ in sweeps.values()))))
  lines = ["| preset | method | " + " | ".join(f"× {f:g}" for f in factors)
           + " | best (seed 0) | the other seeds run at |",
           "|---|---|" + "---|" * len(factors) + "---|---|"]
  for (preset, method), (_, loss, best) in sweeps.items():
    cells = [("–" if f not in loss else f"**{loss[f]:.4f}**" if f == best
              else f"{loss[f]:.4f}") for f in factors]
    bracketed = min(loss) < best < max(loss)
    where = f"× {best:g}" + ("" if bracketed else ", the edge of its sweep so far")
    runs_at = grids.SKEPTIC_LR_BEST.get((preset, method))
    lines.append(f"| {preset} | {method} | {' | '.join(cells)} | {where} | "
                 + ("not chosen yet" if runs_at is None else f"× {runs_at:g}") + " |")
  return "\n".join(lines)


def variant_rows(results: Sequence[Result]) -> list[Row]:
  """Claims rows: every claim (``CLAIMS``) on each of ``VARIANTS``' runs and with each method
  at its best outer lr (``best_lr_results``), where such runs exist."""
  sets = [(label, variant_results(results, kind, prefix), _cell_label, planned)
          for kind, label, prefix, planned in VARIANTS]
  best, chosen = best_lr_results(results)
  if best:  # each cell names its two factors of the authors' outer lrs
    at_best = lambda preset, baseline: (
        f"{_cell_label(preset, baseline)} (× {chosen[(preset, 'heloco')]:g} vs "
        f"× {chosen[(preset, baseline)]:g})")
    sets.append((f"each method at its best outer lr here (× the authors'), jitter "
                 f"{grids.JITTER:g}; not their setting", best, at_best, authors_planned_seeds()))
  rows = []
  for label, runs, cell_label, planned in sets:
    for name, table, presets, baselines, paper in CLAIMS:
      row = Row(f"{name} — {label}", paper, runs, table, presets, baselines, planned,
                label=cell_label)
      if row_seeds(runs, table, presets, baselines, planned):
        rows.append(row)
  return rows


def variant_claim_rows(results: Sequence[Result]) -> list[str]:
  """The claims table's lines of ``variant_rows``."""
  names = {row.name for row in variant_rows(results)}
  return [line for line in claims_table(results).splitlines()
          if line.split(" | ")[0][2:] in names]


def window_table(results: Sequence[Result]) -> str:
  """Markdown: each HeLoCo claims row's verdict, Holm-corrected verdict over the row and over
  the whole family (``judge_family``, of the rows with cells under that window) under each of
  ``WINDOWS`` (the rule's window among them), on the row's seeds."""
  rows = heloco_rows(results)
  found = [[] for _ in rows]
  for _, fractions in WINDOWS:
    judged = judge_family([row.cells(fractions)[0] for row in rows])
    for texts, cells in zip(found, judged):
      texts.append(f"{verdict(cells)}; Holm {verdict(cells, 'holm_category')}; family Holm "
                   f"{verdict(cells, 'family_category')}" if cells else "–")
  lines = [f"| {row.name} | {' | '.join(texts)} |" for row, texts in zip(rows, found)
           if any(t != "–" for t in texts)]
  if not lines:
    return ""
  return "\n".join(["| claim | " + " | ".join(label for label, _ in WINDOWS) + " |",
                    "|---|" + "---|" * len(WINDOWS), *lines])


def loss_table(results: Sequence[Result], table: str) -> str:
  """Markdown: validation loss per preset × method at 25/50/100% of the budget (mean ± sample
  std, ddof = 1; – for one seed)."""
  authors = _authors(results)
  lines = ["| paces | method | 25% | 50% | 100% | seeds |", "|---|---|---|---|---|---|"]
  rows = 0
  for preset in grids.AUTHORS_PRESETS:
    for method in (*grids.METHODS, "cgad"):  # CGAD: issue 35's grid, at its tuned η
      cells = [list(losses(authors, table, preset, method, f).values())
               for f in grids.BUDGET_FRACTIONS]
      if not cells[-1]:
        continue
      rows += 1
      text = " | ".join(f"{np.mean(c):.4f} ± " + (f"{np.std(c, ddof=1):.4f}" if len(c) > 1
                                                     else "–") for c in cells)
      lines.append(f"| {preset} | {method} | {text} | {len(cells[-1])} |")
  return "\n".join(lines) if rows else ""


def _gap_to_sync(loss: float, sync: Sequence[float], method: str) -> str:
  """(L − L_sync) / L_sync in %, against the mean of ``sync``; – for sync DiLoCo or none."""
  if method == "diloco" or not sync:
    return "–"
  return f"{100 * (loss - np.mean(sync)) / np.mean(sync):+.2f}%"


def vocab_table(results: Sequence[Result]) -> str:
  """Markdown: final validation loss at the token budget per ``grids.VOCAB_PRESETS`` and
  ``grids.VOCAB_METHODS`` with the authors' vocabulary size (``grids.vocab_grid``), with the
  2,048-id BPE (the authors grid) and the authors' own (``AUTHORS_FINAL``, mixed paces), each
  with its gap to synchronous DiLoCo ((L − L_sync) / L_sync)."""
  sets = (variant_results(results, f"vocab{grids.VOCAB_50K}"), _authors(results))
  lines = ["| paces | method | " + " | ".join(
      f"{label} | vs sync DiLoCo" for label in (f"{grids.VOCAB_50K:,} ids",
                                                f"{grids.AUTHORS_VOCAB:,} ids",
                                                "the authors' (GPT-2's vocabulary)"))
           + " |", "|---|---|" + "---|" * 6]
  for preset in grids.VOCAB_PRESETS:
    finals = [{m: list(losses(runs, "tokens", preset, m).values()) for m in grids.VOCAB_METHODS}
              for runs in sets]
    if not any(v for m, v in finals[0].items() if m != "diloco"):  # sync's: at every paces
      continue
    for method in grids.VOCAB_METHODS:
      cells = []
      for final in finals:
        if not final[method]:
          cells += ["–", "–"]
          continue
        mean = np.mean(final[method])
        spread = f" ± {np.std(final[method], ddof=1):.4f}" if len(final[method]) > 1 else ""
        cells += [f"{mean:.4f}{spread} ({len(final[method])})",
                  _gap_to_sync(mean, final["diloco"], method)]
      theirs = AUTHORS_FINAL[method]
      cells += (["–", "–"] if preset != "mixed" else  # theirs: paces [1,2,3,1,5]
                [f"{theirs:.2f}", _gap_to_sync(theirs, [AUTHORS_FINAL["diloco"]], method)])
      lines.append(f"| {preset} | {method} | {' | '.join(cells)} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def time_budget_fields(results: Sequence[Result]) -> dict[str, Optional[str]]:
  """The wall-clock section's numbers: T per preset (``time_budgets``), how close to T the
  asynchronous token runs ended (``time_runs_from``, ``time_runs_to``; all None without such
  runs) and what synchronous DiLoCo read in T (``sync_tokens_in_t``, a clause or "")."""
  authors = _authors(results)
  spread, sync = [], []
  for preset in grids.AUTHORS_PRESETS:
    t = grids.time_budget(grids.AUTHORS, preset)
    spread += [r.summary["sim_time"] / t - 1 for r in authors if r.run.table == "tokens"
               and r.run.preset == preset and r.run.method != "diloco"]
    sync_runs = runs_for(authors, "time", preset, "diloco")
    if sync_runs and preset != "homogeneous":
      sync.append(f"{preset} {np.mean([r.summary['tokens'] for r in sync_runs]):,.0f}")
  if not spread:
    return dict.fromkeys(("time_budgets", "time_runs_from", "time_runs_to",
                          "sync_tokens_in_t"))
  return {"time_budgets": ", ".join(f"{p} {grids.time_budget(grids.AUTHORS, p):,.0f} s"
                                    for p in grids.AUTHORS_PRESETS),
          "time_runs_from": f"{100 * min(spread):+.1f}%",
          "time_runs_to": f"{100 * max(spread):+.1f}%",
          "sync_tokens_in_t": ("; in T synchronous DiLoCo read (mean tokens) " + "; ".join(sync))
                              if sync else ""}


def _lr_losses(results: Sequence[Result], method: str) -> dict[float, float]:
  """Factor of the authors' outer lr -> final validation loss of the one-seed lr check (× 1:
  the authors grid's mixed-paces token run of seed 0)."""
  found = {float(r.run.name.rsplit("/x", 1)[1]): r.summary["final_val_loss"]
           for r in results if r.run.table == "lr" and r.run.method == method}
  base = _lr_base(results, method)
  if base is not None:
    found[1.0] = base
  return found if len(found) >= 2 and 1.0 in found else {}


def _lr_base(results: Sequence[Result], method: str) -> Optional[float]:
  """The lr check's × 1: the final loss of the authors grid's mixed token run of seed 0."""
  base = [r for r in runs_for(_authors(results), "tokens", "mixed", method) if r.run.seed == 0]
  return base[0].summary["final_val_loss"] if base else None


def lr_table(results: Sequence[Result]) -> str:
  """Markdown: the one-seed outer-lr check (mixed paces, seed 0, token budget)."""
  from heloco_jax.training import methods  # pylint: disable=g-import-not-at-top
  factors = sorted({*grids.LR_FACTORS, *itertools.chain(*grids.LR_EDGE_FACTORS.values()), 1.0})
  lines = ["| method | authors' lr | " + " | ".join(f"× {f:g}" for f in factors)
           + " | authors' lr vs the best |", "|---|---|" + "---|" * len(factors) + "---|"]
  for method in grids.METHODS:
    found = _lr_losses(results, method)
    if not found:
      continue
    best = min(found, key=found.get)
    cells = [("**" if f == best else "") + (f"{found[f]:.4f}" if f in found else "–")
             + ("**" if f == best else "") for f in factors]
    gap = 100 * (found[1.0] - found[best]) / found[best]
    where = "the best" if best == 1.0 else f"{gap:.2f}% above the best (× {best:g})"
    if best != 1.0 and best in (min(found), max(found)):
      where += ", the edge of its sweep"
    lines.append(f"| {method} | {methods.get(method).learning_rate:g} | {' | '.join(cells)} | "
                 f"{where} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def cgad_lr_note(results: Sequence[Result]) -> str:
  """One sentence: CGAD's η sweep (``grids.cgad_lr_grid``) and the η its grid runs at."""
  found = {float(r.run.name.rsplit("/x", 1)[1]): r.summary["final_val_loss"] for r in results
           if r.run.name.startswith("authors/lr/cgad/x")}
  if not found:
    return ""
  best = min(found, key=found.get)
  cells = ", ".join(f"{grids.CGAD_BASE_LR * f:.2g} " + (f"**{found[f]:.4f}**" if f == best
                                                          else f"{found[f]:.4f}")
                    for f in sorted(found))
  return (f"CGAD (after the paper, so no authors' η): final validation loss at η = {cells}; "
          f"its grid runs at η = {grids.cgad_learning_rate():.2g}"
          + (" (the best here)." if grids.CGAD_TUNED_FACTOR == best else
             f" while the best here is {grids.CGAD_BASE_LR * best:.2g}."))


def lr_note(results: Sequence[Result]) -> str:
  """One sentence: HeLoCo at the authors' lr against each baseline at the best lr of its sweep
  (seed 0), next to the same comparison at the authors' lrs; "" without those runs."""
  heloco = _lr_base(results, "heloco")
  gains = []
  for method in grids.METHODS:
    found = _lr_losses(results, method)
    if method == "heloco" or heloco is None or not found:
      continue
    best = min(found, key=found.get)
    at_best = ("the best of its sweep" if best == 1.0 else
               f"{100 * (found[best] - heloco) / found[best]:+.2f}% at its best (× {best:g})")
    gains.append(f"{method} {100 * (found[1.0] - heloco) / found[1.0]:+.2f}% at its authors' lr, "
                 + at_best)
  if not gains:
    return ""
  return ("HeLoCo at the authors' lr against each baseline (gain as in the claims): "
          + "; ".join(gains) + ".")


def _palsgd_runs(results, c, name):
  return {r.run.seed: r for r in results if r.run.table == f"palsgd_c/c{c:g}"
          and r.run.method == name}


def _fair_runs(results, c, name):
  return {r.run.seed: r for r in results if r.run.table == f"palsgd_fair/c{c:g}"
          and r.run.method == name}


def palsgd_times(results: Sequence[Result], ddp_name: Optional[str] = None
                 ) -> dict[float, dict[str, dict[int, float]]]:
  """c -> method -> seed -> the simulated seconds to that seed's DDP final validation loss
  (DDP's trajectory does not depend on c; its time does). DDP ("ddp") is the palsgd_c grid's,
  or with ``ddp_name`` that palsgd_fair variant (``fair_ddp``); the palsgd_fair grid's PALSGD
  variants join at the c they ran at."""
  out = {}
  for c in grids.COMM_RATIOS:
    ddp = (_fair_runs(results, c, ddp_name) if ddp_name else _palsgd_runs(results, c, "ddp"))
    if not ddp:
      continue
    by_name = {"ddp": ddp, **{
        name: _palsgd_runs(results, c, name if c or name != "ddp_overlap" else "ddp")
        for name in ("ddp_overlap", "diloco", "palsgd", grids.PALSGD_SWAPPED,
                     grids.DILOCO_SWAPPED)}}
    for lr, pull in grids.palsgd_fair_sweep():
      if runs := _fair_runs(results, c, grids.palsgd_fair_name(lr, pull)):
        by_name[grids.palsgd_fair_name(lr, pull)] = runs
    out[c] = {name: {s: analysis.time_to_loss(runs[s].evals, analysis.target_loss(ddp[s]))
                     for s in sorted(runs) if s in ddp} for name, runs in by_name.items()}
  return out


def fair_ddp(results: Sequence[Result]) -> Optional[tuple[str, float]]:
  """(name, factor) of DDP tuned for its own run: of ``grids.DDP_FAIR_LR_FACTORS``' runs at
  c = 0 (its trajectory does not depend on c), the lowest mean final validation loss over the
  seeds every factor has (None until every factor has one)."""
  runs = {f: _fair_runs(results, 0.0, grids.ddp_fair_name(f)) for f in grids.DDP_FAIR_LR_FACTORS}
  seeds = set.intersection(*(set(r) for r in runs.values()))
  if not seeds:
    return None
  best = min(runs, key=lambda f: np.mean([runs[f][s].summary["final_val_loss"] for s in seeds]))
  return grids.ddp_fair_name(best), best


def _speedup(reference: Sequence[float], method: Sequence[float]) -> float:
  """How much sooner (%) ``method`` reaches the target than ``reference``, mean over seeds."""
  if not reference or not method or not np.all(np.isfinite(method)):
    return -math.inf
  return float(100 * (np.mean(reference) - np.mean(method)) / np.mean(reference))


def _gain(t: dict[str, dict[int, float]], reference: str, method: str) -> float:
  """``_speedup`` over the seeds both have (nan: none)."""
  seeds = sorted(set(t[reference]) & set(t[method]))
  return _speedup([t[reference][s] for s in seeds],
                  [t[method][s] for s in seeds]) if seeds else math.nan


def crossover(times: dict[float, dict[str, dict[int, float]]], reference: str,
              method: str = "palsgd") -> Optional[float]:
  """The smallest c from which on ``method`` reaches the target sooner than ``reference``."""
  wins = [(c, _gain(t, reference, method) > 0) for c, t in sorted(times.items())]
  for i, (c, _) in enumerate(wins):
    if all(w for _, w in wins[i:]):
      return c
  return None


def palsgd_table(results: Sequence[Result]) -> str:
  times = palsgd_times(results)
  if not times:
    return ""
  swapped = grids.PALSGD_SWAPPED
  lines = ["| c (all-reduce ÷ step) | DDP s | DDP overlapped s | DiLoCo s | PALSGD s | PALSGD vs "
           "DDP | PALSGD vs DDP overlapped | DiLoCo vs DDP | PALSGD at outer lr 0.7 s | its vs "
           "DDP | seeds |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for c, t in sorted(times.items()):
    secs = [("–" if not t[m] else f"{np.mean(list(t[m].values())):,.0f}"
             if np.all(np.isfinite(list(t[m].values()))) else "not reached")
            for m in ("ddp", "ddp_overlap", "diloco", "palsgd", swapped)]
    gains = [_gain(t, ref, m) for ref, m in (("ddp", "palsgd"), ("ddp_overlap", "palsgd"),
                                             ("ddp", "diloco"), ("ddp", swapped))]
    pct = [f"{g:+.1f}%" if np.isfinite(g) else "–" for g in gains]
    cells = [*secs[:4], *pct[:3], secs[4], pct[3]]
    lines.append(f"| {c:g} | {' | '.join(cells)} | {len(t['ddp'])} |")
  for method, name in (("palsgd", "PALSGD"), (swapped, "PALSGD at outer lr 0.7")):
    missing = [f"{c:g}" for c, t in sorted(times.items()) if not t[method]]
    if len(missing) == len(times):
      continue
    if missing:
      lines += ["", f"{name}: no runs yet at c = {', '.join(missing)}, so no crossover."]
      continue
    for reference, label in (("ddp", "DDP"), ("ddp_overlap", "overlapped DDP")):
      c = crossover(times, reference, method)
      lines.append("")
      lines.append(f"{name} reaches DDP's loss sooner than {label} from c = {c:g} on."
                   if c is not None else f"{name} is not faster than {label} at any c measured.")
  return "\n".join(lines)


def palsgd_why_table(results: Sequence[Result]) -> str:
  """Markdown: PALSGD and DiLoCo each at both outer lrs (the palsgd_c runs at c =
  ``grids.PALSGD_WHY_C``, the palsgd_why grid's among them): final loss, time to DDP's loss."""
  c = grids.PALSGD_WHY_C
  t = palsgd_times(results).get(c)
  rows = [(f"PALSGD, the authors' {grids.PALSGD_OUTER_LR:g}", "palsgd"),
          ("PALSGD, DiLoCo's 0.7", grids.PALSGD_SWAPPED), ("DiLoCo, its 0.7", "diloco"),
          (f"DiLoCo, PALSGD's {grids.PALSGD_OUTER_LR:g}", grids.DILOCO_SWAPPED)]
  if not t or not any(t[name] for _, name in rows[1::2]):
    return ""

  def final_loss(name, seeds):
    runs = _palsgd_runs(results, c, name)
    return np.mean([runs[s].summary["final_val_loss"] for s in seeds])
  lines = [f"| run (outer lr) | final val loss, 2× DDP's tokens | reaches DDP's loss | time to "
           f"DDP's loss at c = {c:g}, s | vs DDP | seeds |", "|---|---|---|---|---|---|",
           f"| DDP | {final_loss('ddp', t['ddp']):.4f} (its tokens) | – | "
           f"{np.mean(list(t['ddp'].values())):,.0f} | – | {len(t['ddp'])} |"]
  for label, name in rows:
    if not t[name]:
      continue
    times = list(t[name].values())
    reached = sum(np.isfinite(times))
    lines.append(
        f"| {label} | {final_loss(name, t[name]):.4f} | {reached} of {len(times)} seeds | "
        + (f"{np.mean(times):,.0f} | {_gain(t, 'ddp', name):+.1f}%" if reached == len(times)
           else "– | –")
        + f" | {len(times)} |")
  return "\n".join(lines)


def _fastest_worker(preset: str, num_workers: int = 5) -> int:
  return int(np.argmin(clocks.seconds_per_step(preset, num_workers)))


def fastest_worker_steps_taken(result: Result, num_workers: int = 5) -> int:
  """The local steps the fastest worker took: its arrivals × H (asynchronous), or one K-th of
  the tokens (synchronous DiLoCo: every worker takes H steps each round)."""
  keys = dict(result.run.overrides)
  if result.run.method == "diloco":
    return int(result.summary["tokens"]
               // (num_workers * keys["batch_size"] * keys["model.context"]))
  fastest = _fastest_worker(result.run.preset, num_workers)
  return keys["inner_steps"] * sum(a["worker"] == fastest for a in result.arrivals)


def _decay_runs(results: Sequence[Result]) -> list[tuple[str, str, Optional[int], list[Result]]]:
  """(method, inner lr schedule, its decay span or None, runs by seed) at
  ``grids.DECAY_WHY_PRESET`` and the time budget: the authors grid's (cosine over 2,000 steps)
  and the decay_why grid's variants (``grids.decay_why_changes``)."""
  preset = grids.DECAY_WHY_PRESET
  span = grids.AUTHORS.inner_total_steps
  rows = [(method, f"cosine over {span:,} steps", span,
           runs_for(_authors(results), "time", preset, method))
          for method in ("async_nesterov", "mla", "heloco", "diloco")]
  for variant, changes in grids.decay_why_changes().items():
    span = changes.get("inner.total_steps")
    label = f"cosine over {span:,} steps" if span else f"constant {grids.AUTHORS.inner_learning_rate:g}"
    rows += [(method, label, span, sorted((r for r in results if r.run.table == variant
                                           and r.run.method == method), key=lambda r: r.run.seed))
             for method in grids.DECAY_WHY_METHODS]
  return rows


def _fast_language(preset: str) -> str:
  """The language of the fastest worker (non-IID: worker i reads language i)."""
  return grids.LANGUAGES.split(",")[_fastest_worker(preset)]


def _losses_at_t(result: Result) -> tuple[float, float, float]:
  """Validation loss at T: overall, on the fastest worker's language, on the others (mean)."""
  t = grids.time_budget(grids.AUTHORS, result.run.preset)
  fast = _fast_language(result.run.preset)
  others = [x for x in grids.LANGUAGES.split(",") if x != fast]
  return (loss_at(result, "time", 1.0), loss_at_time(result.evals, t, f"val_loss/{fast}"),
          float(np.mean([loss_at_time(result.evals, t, f"val_loss/{x}") for x in others])))


def heloco_vs_sync_by_decay(results: Sequence[Result]) -> dict[str, dict[str, Any]]:
  """Inner lr schedule -> HeLoCo against synchronous DiLoCo at T at ``grids.DECAY_WHY_PRESET``
  (the seeds both have; the authors' schedule first): ``gain`` (%), ``wins`` (seeds where
  HeLoCo is lower) of ``seeds``, and the gains on the fastest worker's language (``fast``) and
  on the others (``others``)."""
  at_t = {(method, label): {r.run.seed: _losses_at_t(r) for r in runs}
          for method, label, _, runs in _decay_runs(results)}
  out = {}
  for label in dict.fromkeys(label for _, label in at_t):
    heloco, sync = at_t[("heloco", label)], at_t[("diloco", label)]
    seeds = sorted(set(heloco) & set(sync))
    if seeds:
      h, b = np.array([heloco[s] for s in seeds]), np.array([sync[s] for s in seeds])
      gains = [analysis._improvement(x, y) for x, y in zip(b.mean(0), h.mean(0))]  # pylint: disable=protected-access
      out[label] = {"gain": gains[0], "fast": gains[1], "others": gains[2],
                    "wins": int(np.sum(h[:, 0] < b[:, 0])), "seeds": len(seeds)}
  return out


def decay_why_table(results: Sequence[Result]) -> str:
  """Markdown: at ``grids.DECAY_WHY_PRESET``, each method's loss at T overall and on the fastest
  worker's language under the authors' inner lr schedule and the decay_why grid's, and HeLoCo
  against synchronous DiLoCo under each."""
  preset = grids.DECAY_WHY_PRESET
  if not any(r.run.table in grids.DECAY_WHY_VARIANTS for r in results):
    return ""
  language = _fast_language(preset)
  key = f"val_loss/{language}"
  t = grids.time_budget(grids.AUTHORS, preset)
  lines = [f"| method | inner lr | loss at T | on {language}: lowest (at s) | on {language} at T "
           "| other languages at T | fastest worker's steps (past its decay) | seeds |",
           "|---|---|---|---|---|---|---|---|"]
  for method, label, span, runs in _decay_runs(results):
    if not runs:
      continue
    lowest = [min((e for e in r.evals if e["sim_time"] <= t), key=lambda e: e[key])
              for r in runs]
    steps = [fastest_worker_steps_taken(r) for r in runs]
    past = f"{np.mean([max(0, s - span) for s in steps]):,.0f}" if span else "–"
    overall, fast, others = np.mean([_losses_at_t(r) for r in runs], axis=0)
    lines.append(
        f"| {method} | {label} | {overall:.4f} | {np.mean([e[key] for e in lowest]):.4f} "
        f"({np.mean([e['sim_time'] for e in lowest]):,.0f}) | {fast:.4f} | {others:.4f} | "
        f"{np.mean(steps):,.0f} ({past}) | {len(runs)} |")
  for label, c in heloco_vs_sync_by_decay(results).items():
    lines += ["", f"Inner lr {label}: HeLoCo against synchronous DiLoCo at T {c['gain']:+.2f}% "
              f"(lower on {c['wins']} of {c['seeds']} seeds): {c['fast']:+.2f}% on {language}, "
              f"{c['others']:+.2f}% on the other languages."]
  return "\n".join(lines)


def palsgd_claim(results: Sequence[Result], method: str = "palsgd",
                 ddp_name: Optional[str] = None, cs: Optional[Sequence[float]] = None
                 ) -> Optional[tuple[str, str]]:
  """(verdict, measured) for the PALSGD claim: ``method`` (PALSGD as its authors ran it,
  ``grids.PALSGD_SWAPPED``, or a palsgd_fair variant) against DDP (the palsgd_c grid's, or the
  palsgd_fair variant ``ddp_name``), time to each seed's DDP final loss, at each of ``cs``
  (default: every c DDP ran at).

  *reproduced* when it is faster than DDP on every seed (≥ 3) at **every** c; *partly* when it
  is faster on every seed at some c, or its mean gain is positive at the best c; *not
  reproduced* otherwise (pending while any c has fewer than 3 seeds)."""
  times = palsgd_times(results, ddp_name)
  if cs is not None:
    times = {c: times.get(c, {"ddp": {}, method: {}}) for c in cs}
  if not any(t.get(method) for t in times.values()):
    return None
  per_c = []
  for c, t in sorted(times.items()):
    if not t.get(method):
      continue  # not run yet at this c
    seeds = [t["ddp"][s] > t[method][s] for s in t[method]]
    per_c.append((c, _gain(t, "ddp", method), all(seeds) and len(seeds) >= 3, any(seeds)))
  best = max(per_c, key=lambda x: x[1])
  text = ", ".join(f"c={c:g}: " + (f"{g:+.1f}%" if np.isfinite(g) else "DDP's loss not reached")
                   for c, g, _, _ in per_c)
  if len(per_c) < len(times) or any(len(t["ddp"]) < 3 or len(t.get(method, {})) < 3
                                     for t in times.values()):
    return "pending (fewer than 3 seeds)", f"faster than DDP by {text} (mean over seeds)"
  if all(every for _, _, every, _ in per_c):
    verdict_text = "**reproduced**"
  elif any(every for _, _, every, _ in per_c) or best[1] > 0:
    verdict_text = "**partly**"
  else:
    verdict_text = "**not reproduced**"
  return verdict_text, f"faster than DDP by {text} (mean over seeds)"


def curves(results: Sequence[Result], fig_dir: str) -> list[str]:
  """Mean validation loss over seeds vs local steps and vs simulated time, per paces."""
  plt = analysis._pyplot(fig_dir)  # pylint: disable=protected-access
  authors = _authors(results)
  paths = []
  presets = [p for p in grids.AUTHORS_PRESETS if runs_for(authors, "tokens", p, "heloco")]
  if not presets:
    return paths
  tokens_per_step = grids.AUTHORS.batch_size * grids.AUTHORS.context
  for table, axis, label in (("tokens", "tokens", "local steps (all workers)"),
                             ("time", "sim_time", "simulated seconds")):
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
      for color, method in enumerate(grids.METHODS):
        runs = runs_for(authors, table, preset, method)
        if not runs:
          continue
        n = min(len(r.evals) for r in runs)
        x = np.mean([[e[axis] for e in r.evals[:n]] for r in runs], axis=0)
        y = np.array([[e["val_loss"] for e in r.evals[:n]] for r in runs])
        if axis == "tokens":
          x = x / tokens_per_step
        ax.plot(x, y.mean(0), color=f"C{color}", lw=1.3, label=method)
        ax.fill_between(x, y.min(0), y.max(0), color=f"C{color}", alpha=0.15)
      if table == "time":
        ax.axvline(grids.time_budget(grids.AUTHORS, preset), color="k", lw=0.6, ls="--")
      ax.set_title(f"{preset} paces")
      ax.set_xlabel(label)
      ax.set_ylabel("validation loss")
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    paths.append(analysis._save(fig, os.path.join(  # pylint: disable=protected-access
        fig_dir, f"authors_loss_vs_{'steps' if axis == 'tokens' else 'sim_time'}.png")))
  return paths


def palsgd_figure(results: Sequence[Result], fig_dir: str) -> list[str]:
  times = palsgd_times(results)
  if not times:
    return []
  plt = analysis._pyplot(fig_dir)  # pylint: disable=protected-access
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  cs = sorted(times)
  for (reference, method), style in zip(
      (("ddp", "palsgd"), ("ddp_overlap", "palsgd"), ("ddp", "diloco"),
       ("ddp", grids.PALSGD_SWAPPED)), ("o-", "s--", "^:", "D-.")):
    measured = [c for c in cs if times[c][method]]
    if not measured:
      continue
    gains = [_gain(times[c], reference, method) for c in measured]
    missing = "" if any(np.isfinite(gains)) else " (DDP's loss not reached)"
    ax.plot(measured, [g if np.isfinite(g) else np.nan for g in gains], style,
            label=f"{method.replace('_lr', ' at outer lr ')} vs {reference.replace('_', ' ')}"
                  f"{missing}")
  ax.axhline(0, color="k", lw=0.6)
  ax.set_xlabel("c = all-reduce seconds ÷ step seconds")
  ax.set_ylabel("reaches DDP's final loss sooner (%)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return [analysis._save(fig, os.path.join(fig_dir, "palsgd_speedup_vs_c.png"))]  # pylint: disable=protected-access


# RESULTS.md's words: the page with a placeholder for each computed part (module docstring).
TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.template.md")


def render(template: str, fields: dict[str, Optional[str]]) -> str:
  """``template`` (RESULTS.template.md's text) with ``fields`` in its ``$name`` placeholders,
  by the rules of the module docstring: a paragraph with a placeholder whose value is None is
  left out, and the whole section with it when the placeholder's name ends in ``_table``.
  Raises KeyError for a placeholder without a field and ValueError for a field without one."""
  sections: list[list[string.Template]] = []
  for paragraph in template.split("\n\n"):
    if paragraph.startswith("#") or not sections:
      sections.append([])
    sections[-1].append(string.Template(paragraph))
  kept, used = [], set()
  for section in sections:
    names = [p.get_identifiers() for p in section]
    used.update(itertools.chain(*names))
    if any(fields[n] is None for n in itertools.chain(*names) if n.endswith("_table")):
      continue
    kept += [p.substitute(fields) for p, ns in zip(section, names)
             if all(fields[n] is not None for n in ns)]
  if set(fields) - used:
    raise ValueError(f"fields {sorted(set(fields) - used)} have no placeholder in the template")
  return "\n\n".join(kept)


def write_results(results: Sequence[Result], path: str, fig_dir: str, command: str,
                  scale_note: str, small_scale: str = "RESULTS_small_scale.md",
                  sections: Sequence[str] = (), *, planned: int,
                  dates: Optional[dict[str, float]] = None) -> None:
  """Writes RESULTS.md for issue 18's and 36's grids (``TEMPLATE`` with this function's
  numbers, tables and figure list) with its figures under ``fig_dir``, and ``sections``
  (markdown lines: other grids' sections) before the small-scale note. ``planned``: how many
  runs ``results`` are drawn from (finished or not); ``dates``: the runs' (``digest_dates``),
  for the claims table's *rule* column."""
  authors = [r for r in _authors(results) if r.run.table == "tokens"]
  figures = (curves(results, fig_dir) + palsgd_figure(results, fig_dir)
             + analysis.diagnostics_figures(authors, fig_dir, presets=grids.AUTHORS_PRESETS,
                                            branches_preset="mixed"))
  rel = lambda p: os.path.relpath(p, os.path.dirname(os.path.abspath(path)))
  on_gpu = [r for r in results if r.run.name.startswith(grids.SCALE_PREFIX)]
  on_cpu = [r for r in results if not r.run.name.startswith(grids.SCALE_PREFIX)]
  steps_per_second = 1 / clocks.seconds_per_step(grids.DECAY_WHY_PRESET, 5)
  optional = lambda text: f" {text}" if text else ""  # a sentence that may be missing
  tables = {"claims_table": claims_table(results, dates), "window_table": window_table(results),
            "token_table": loss_table(results, "tokens"),
            "time_table": loss_table(results, "time"), "lr_table": lr_table(results),
            "skeptic_lr_table": skeptic_lr_table(results), "palsgd_table": palsgd_table(results),
            "palsgd_why_table": palsgd_why_table(results),
            "palsgd_fair_table": palsgd_fair_table(results),
            "palsgd8m_table": palsgd8m_table(results), "vocab_table": vocab_table(results),
            "decay_why_table": decay_why_table(results)}
  fields = {
      "command": command, "finished": str(len(on_cpu)), "planned": str(planned),
      "core_hours": f"{sum(r.summary.get('wall_seconds', 0.0) for r in on_cpu) / 3600:.1f}",
      "finished_gpu": str(len(on_gpu)), "planned_gpu": str(len(grids.grid("scale"))),
      "scale_note": scale_note,
      **{name: table or None for name, table in tables.items()},  # no runs: no section
      "rejudged": REJUDGED, "pre_registered": PRE_REGISTERED, "undated": UNDATED,
      **dict(zip(("family_cells", "family_rows", "family_changed"),
                 map(str, family_changes(results)))),
      "tie_margin": f"{TIE_MARGIN:g}",
      "symmetric_seeds": ", ".join(map(str, grids.SYMMETRIC_SEEDS)),
      "planned_seeds": str(len(authors_planned_seeds())),
      "authors_final": ", ".join(f"{m} {v}" for m, v in AUTHORS_FINAL.items()),
      **time_budget_fields(results),
      "lr_factors": ", ".join(f"{f:g}" for f in grids.LR_FACTORS),
      "lr_edge_factors": "; ".join(f"{m} also × " + ", ".join(f"{f:g}" for f in fs)
                                   for m, fs in grids.LR_EDGE_FACTORS.items()),
      "lr_note": optional(lr_note(results)), "cgad_lr_note": optional(cgad_lr_note(results)),
      "jitter": f"{grids.JITTER:g}", "palsgd_why_c": f"{grids.PALSGD_WHY_C:g}",
      "ddp_own_steps": f"{grids.ddp_own_steps():,}",
      "ddp_fair_lr_factors": ", ".join(f"{f:.3g}" for f in grids.DDP_FAIR_LR_FACTORS),
      "palsgd8m_c": f"{grids.PALSGD8M_C:g}",
      "palsgd8m_ddp_factors": ", ".join(f"{f:.3g}" for f in grids.PALSGD8M_DDP_FACTORS),
      "vocab_50k": f"{grids.VOCAB_50K:,}", "authors_vocab": f"{grids.AUTHORS_VOCAB:,}",
      "fast_share": f"{steps_per_second.max() / steps_per_second.sum():.0%}",
      "fast_worker_steps": f"{grids.fastest_worker_steps(grids.AUTHORS, 'severe'):,}",
      "figures": "\n".join(f"![{os.path.basename(f)}]({rel(f)})" for f in figures) or None,
      "sections": "\n".join(sections).removesuffix("\n") or None,
      "small_scale": small_scale}
  with open(TEMPLATE) as f:
    page = render(f.read(), fields)
  with open(path, "w") as f:
    f.write(page)
