"""The grids of ``python -m experiments.reproduce``: which runs, with which config overrides.

A grid is a list of ``Run``s; each is one ``heloco-jax train`` with dotted config
overrides, written to ``OUT/runs/<name>``. Two tables share the paper grid:

  * ``tokens``: a fixed token budget (``Scale.tokens``) for every method;
  * ``time``: a fixed simulated wall-clock budget per preset, the time the
    asynchronous workers need for the same tokens when no one waits:
    T = tokens / (batch·context·Σ_i 1/t_i). Synchronous DiLoCo reads fewer
    tokens in T because every round waits for the slowest worker.

Everything else is the quickstart's (``heloco_jax/cli/configs/default.py``): the
outer learning rates and momenta of ALGORITHMS.md and one inner learning rate
for all methods.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from heloco_jax.runtime import clocks

PRESETS = ("homogeneous", "mild", "moderate", "severe")
METHODS = ("async_nesterov", "delayed_nesterov", "mla", "heloco", "diloco")
BASELINES = tuple(m for m in METHODS if m != "heloco")
LANGUAGES = "de,en,es,fr,it"


@dataclasses.dataclass(frozen=True)
class Scale:
  """Model, batch and budget of a grid (the paper's are far larger; see RESULTS.md)."""
  d_model: int = 96
  num_layers: int = 2
  num_heads: int = 4
  context: int = 64
  batch_size: int = 4
  inner_steps: int = 20
  tokens: int = 1_000_000
  eval_every_tokens: int = 100_000
  inner_total_steps: int = 4_000  # the cosine decay spans about all steps of one run
  # From the tune grid (6e-4: 2.499, 1e-3: 2.501, 3e-4: 2.537, 2e-3: 2.570, 3e-3: 2.638,
  # 6e-3: 2.703 final val loss), used for every method of the paper and palsgd grids.
  inner_learning_rate: float = 6e-4
  seeds: tuple[int, ...] = (0, 1, 2)
  data: tuple[tuple[str, Any], ...] = (("data.source", "text_dir"),
                                       ("data.languages", LANGUAGES))
  extra: tuple[tuple[str, Any], ...] = ()  # any further config keys

  def overrides(self) -> dict[str, Any]:
    return {"model.d_model": self.d_model, "model.num_layers": self.num_layers,
            "model.num_heads": self.num_heads, "model.context": self.context,
            "batch_size": self.batch_size, "inner_steps": self.inner_steps,
            "inner.total_steps": self.inner_total_steps,
            "inner.learning_rate": self.inner_learning_rate,
            "budget.eval_every_tokens": self.eval_every_tokens, **dict(self.data), **dict(self.extra)}


PAPER = Scale()
SMOKE = Scale(d_model=32, num_layers=1, num_heads=4, context=16, batch_size=4, inner_steps=2,
              tokens=6_000, eval_every_tokens=1_000, inner_total_steps=400,
              inner_learning_rate=3e-3, seeds=(0,),
              data=(("data.source", "synthetic"), ("data.max_bytes_per_language", 40_000),
                    ("data.val_sequences_per_language", 8)))


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run of a grid.

  Attributes:
    name: unique within the grid; the run's workdir is ``OUT/runs/<name>``.
    table: "tokens" (fixed token budget) or "time" (fixed simulated time).
    preset: the speed preset.
    method: the method.
    seed: the seed.
    overrides: dotted config keys and values, applied in order.
  """
  name: str
  table: str
  preset: str
  method: str
  seed: int
  overrides: tuple[tuple[str, Any], ...]

  def args(self, data_path: str = "") -> list[str]:
    """The ``heloco-jax train`` config flags of this run (``CORPUS`` in a value: the corpus
    folder ``data_path``)."""
    overrides = dict(self.overrides)
    if data_path and overrides.get("data.source") == "text_dir" and "data.path" not in overrides:
      overrides["data.path"] = data_path  # a run's own data.path: a folder next to it
    return [f"--config.{key}={_flag(value).replace(CORPUS, data_path)}"
            for key, value in overrides.items()]

  def needs_corpus(self) -> bool:
    return dict(self.overrides).get("data.source") == "text_dir"


CORPUS = "{corpus}"


def _flag(value: Any) -> str:
  return str(list(value)) if isinstance(value, (list, tuple)) else str(value)


def time_budget(scale: Scale, preset: str, num_workers: int = 5) -> float:
  """Simulated seconds in which non-waiting workers read ``scale.tokens`` tokens."""
  steps_per_second = np.sum(1.0 / clocks.seconds_per_step(preset, num_workers))
  return float(scale.tokens / (scale.batch_size * scale.context * steps_per_second))


def main_grid(scale: Scale, presets=PRESETS, methods=METHODS) -> list[Run]:
  """The HeLoCo comparison: every preset × method × seed, at both budgets."""
  runs = []
  for table in ("tokens", "time"):
    for preset in presets:
      budget = ({"budget.tokens": scale.tokens, "budget.sim_seconds": 0.0} if table == "tokens"
                else {"budget.tokens": 0, "budget.sim_seconds": time_budget(scale, preset)})
      for method in methods:
        for seed in scale.seeds:
          overrides = {**scale.overrides(), "method": method, "seed": seed, "speeds": preset,
                       **budget}
          runs.append(Run(f"{table}/{preset}/{method}/seed{seed}", table, preset, method, seed,
                          tuple(overrides.items())))
  return runs


# The inner learning rate is tuned once, on synchronous DiLoCo with homogeneous workers and
# a seed outside the grid's, and the best is then used for every method (RESULTS.md).
TUNE_LEARNING_RATES = (3e-4, 6e-4, 1e-3, 2e-3, 3e-3, 6e-3)
TUNE_SEED = 100


def tune_grid(scale: Scale) -> list[Run]:
  """Synchronous DiLoCo, homogeneous, seed 100, at the token budget, one run per rate."""
  return [Run(f"tune/diloco/lr{lr:g}", "tune", "homogeneous", "diloco", TUNE_SEED,
              tuple({**scale.overrides(), "method": "diloco", "seed": TUNE_SEED,
                     "speeds": "homogeneous", "budget.tokens": scale.tokens,
                     "inner.learning_rate": lr}.items()))
          for lr in TUNE_LEARNING_RATES]


# PALSGD vs DDP vs DiLoCo (ALGORITHMS.md, "PALSGD"): homogeneous workers, one ring
# all-reduce costing a quarter of a DDP step (1 s per step, 0.25 s per all-reduce).
ALLREDUCE_SECONDS = 0.25


def palsgd_grid(scale: Scale) -> list[Run]:
  """ddp at the token budget; diloco and palsgd at twice it, so that the time at which they
  reach DDP's final loss can be measured even where they need more tokens than DDP. The
  schedule (``inner_total_steps``) is unchanged, so their first ``tokens`` are the 1× run's."""
  runs = []
  for method, factor in (("ddp", 1), ("diloco", 2), ("palsgd", 2)):
    for seed in scale.seeds:
      overrides = {**scale.overrides(), "method": method, "seed": seed, "speeds": "homogeneous",
                   "comm.latency": ALLREDUCE_SECONDS, "budget.tokens": factor * scale.tokens,
                   "budget.eval_every_tokens": scale.eval_every_tokens // 4}
      name = f"palsgd/{method}/seed{seed}" if factor == 1 else (
          f"palsgd/{method}_x{factor}/seed{seed}")
      runs.append(Run(name, "palsgd", "homogeneous", method, seed, tuple(overrides.items())))
  return runs


GRIDS = {
    "paper": lambda: main_grid(PAPER),
    "smoke": lambda: main_grid(SMOKE, presets=("homogeneous", "severe")),
    "tune": lambda: tune_grid(PAPER),
    "palsgd": lambda: palsgd_grid(PAPER),
    "ablations": lambda: ablation_grid(PAPER),
    # Everything experiments/RESULTS.md reports, in the order it is needed.
    "all": lambda: tune_grid(PAPER) + main_grid(PAPER) + palsgd_grid(PAPER) + ablation_grid(PAPER),
}


# Ablations (issue "Reproduction and analysis", item 4), all at the severe preset and the token
# budget; each variant is compared with the paper grid's run of the same method and seed.
ABLATIONS: dict[str, tuple[tuple[str, tuple[str, ...], dict[str, Any]], ...]] = {
    "rotate_schedule": (("eq14", ("heloco",), {"outer.rotate_schedule": "eq14"}),),
    "weight_order": (("after", ("heloco",), {"outer.weight_order": "after"}),),
    "lookahead_dispatch": (("on", ("mla",), {"lookahead_dispatch": True}),),
    "partition": tuple((name, ("heloco", "mla"), overrides) for name, overrides in (
        ("iid", {"data.partition": "iid"}),
        ("dirichlet0.1", {"data.partition": "dirichlet", "data.dirichlet_alpha": 0.1}),
        ("dirichlet1", {"data.partition": "dirichlet", "data.dirichlet_alpha": 1.0}),
        ("dirichlet10", {"data.partition": "dirichlet", "data.dirichlet_alpha": 10.0}))),
    "num_workers": tuple((f"K{k}", ("heloco", "mla"), {"num_workers": k}) for k in (16, 64)),
}


# One seed per variant keeps the ablations to ~15 CPU minutes; RESULTS.md sets each next to
# the paper grid's mean ± std over its seeds, so a change within seed noise shows as such.
ABLATION_SEEDS = (0,)


def ablation_grid(scale: Scale) -> list[Run]:
  """Every ablation variant × its methods × ``ABLATION_SEEDS`` (the baselines are the paper
  grid's runs)."""
  runs = []
  for ablation, variants in ABLATIONS.items():
    for variant, methods, changes in variants:
      for method in methods:
        for seed in ABLATION_SEEDS:
          overrides = {**scale.overrides(), "method": method, "seed": seed, "speeds": "severe",
                       "budget.tokens": scale.tokens, **changes}
          runs.append(Run(f"ablation/{ablation}/{variant}/{method}/seed{seed}",
                          f"ablation/{ablation}/{variant}", "severe", method, seed,
                          tuple(overrides.items())))
  return runs


SCALES = {"paper": PAPER, "smoke": SMOKE, "tune": PAPER, "palsgd": PAPER, "ablations": PAPER,
          "all": PAPER}


def family(name: str) -> list[Run]:
  """Every run of the grids at ``name``'s scale: the runs a RESULTS.md of that scale reports."""
  scale = SCALES[name]
  if scale is SMOKE:
    return grid(name)
  if name in ONE_REPORT:
    runs = (grid("science") + grid("skeptic") + grid("streaming") + grid("cgad_lr")
            + grid("cgad") + grid("chaos") + grid("symmetric") + grid("scale") + grid("body")
            + grid("palsgd8m") + grid("faulty") + grid("merge_order"))
    return list(dict.fromkeys(runs))  # the symmetric grid lists runs of the others too
  return grid("all")


def grid(name: str) -> list[Run]:
  """The runs of grid ``name`` (``GRIDS``)."""
  if name not in GRIDS:
    raise ValueError(f"--grid={name!r} is not allowed; allowed: {', '.join(GRIDS)}.")
  return GRIDS[name]()


# Issue 18: the HeLoCo authors' language-model harness (heloco_stable_v2.py, aaasif-isu/
# panofabric-engine): TinyGPT d_model 128, 8 layers, 4 heads, context 128, batch 2 × 128 tokens,
# H = 20, 10,000 local steps in all; inner AdamW lr 2e-4, betas (0.9, 0.999), weight decay 1e-2,
# no clipping, a fresh AdamW state at every dispatch, and a cosine decay from 2e-4 to 1e-6 over
# each worker's own 2,000 steps without warm-up. Outer rules at the registry's defaults, which are
# the authors' (async Nesterov 0.07, MLA, HeLoCo and sync 0.7, μ 0.9, ρ = 1/√5). One change:
# the authors' GPT-2 vocabulary (50,257 ids) becomes a 2,048-id byte-level BPE trained on the
# corpus (``heloco-jax corpus bpe --vocab-size=2048``): at 2,048 ids a step costs 0.80× what it
# costs at 8,192 on this CPU (4,216 vs 3,376 tokens/s), and the depth stays the authors'.
AUTHORS_VOCAB = 2048
AUTHORS = Scale(
    d_model=128, num_layers=8, num_heads=4, context=128, batch_size=2, inner_steps=20,
    tokens=10_000 * 2 * 128, eval_every_tokens=10_000 * 2 * 128 // 20, inner_total_steps=2_000,
    inner_learning_rate=2e-4, seeds=(0, 1, 2),
    data=(("data.source", "text_dir"), ("data.languages", LANGUAGES),
          ("data.tokenizer", f"{CORPUS}/tokenizer.json"),
          ("data.val_sequences_per_language", 32)),
    extra=(("inner.warmup_steps", 0), ("inner.min_learning_rate_ratio", 1e-6 / 2e-4),
           ("inner.weight_decay", 1e-2), ("inner.grad_clip", 0.0), ("inner.reset_optimizer", True),
           ("checkpoint.every", 50)))
# The paper's four presets and the authors' own mix (WORKER_PACES = [1, 2, 3, 1, 5]).
AUTHORS_PRESETS = ("homogeneous", "mild", "moderate", "severe", "mixed")
# The budget points at which RESULTS.md reports losses (evaluations fall on each of them).
BUDGET_FRACTIONS = (0.25, 0.5, 1.0)


def authors_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """Every preset × method at the token budget, and synchronous DiLoCo at the time budget.

  At the time budget the asynchronous methods are their token runs: non-waiting workers read
  the token budget in ``time_budget`` (they end within one arrival of it; RESULTS.md gives the
  spread). Synchronous DiLoCo reads fewer tokens in that time, so it has its own run, except
  with homogeneous workers, where no one waits and its token run is that run.

  Synchronous DiLoCo has one token run per seed, the homogeneous one: every round waits for
  all workers, so paces change its clock but not its trajectory in tokens (seed 0's token runs
  at all five paces, run before this was used, gave the same evaluations bit for bit).
  """
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    for preset in AUTHORS_PRESETS:
      for method in METHODS:
        if method == "diloco" and preset != "homogeneous":
          continue  # the homogeneous token run (above)
        overrides = {**scale.overrides(), "method": method, "seed": seed, "speeds": preset,
                     "budget.tokens": scale.tokens, "budget.sim_seconds": 0.0}
        runs.append(Run(f"authors/tokens/{preset}/{method}/seed{seed}", "tokens", preset,
                        method, seed, tuple(overrides.items())))
      if preset == "homogeneous":
        continue
      overrides = {**scale.overrides(), "method": "diloco", "seed": seed, "speeds": preset,
                   "budget.tokens": 0, "budget.sim_seconds": time_budget(scale, preset)}
      runs.append(Run(f"authors/time/{preset}/diloco/seed{seed}", "time", preset, "diloco",
                      seed, tuple(overrides.items())))
  return runs


# Outer learning rates of the one-seed check: the authors' (the registry default) times these.
LR_FACTORS = (0.25, 0.5, 2.0)
# ... and further up where the best of LR_FACTORS was its top edge, so that the sweep brackets
# each method's best (measured: Delayed Nesterov's loss fell at × 2, × 4 and × 8 again).
LR_EDGE_FACTORS = {"delayed_nesterov": (4.0, 8.0, 16.0, 32.0)}


def authors_lr_grid(scale: Scale = AUTHORS) -> list[Run]:
  """Each method's outer lr × ``LR_FACTORS`` (and ``LR_EDGE_FACTORS``), mixed paces, seed 0,
  token budget (× 1 is the authors grid's run)."""
  from heloco_jax.training import methods  # pylint: disable=g-import-not-at-top
  runs = []
  for method in METHODS:
    for factor in LR_FACTORS + LR_EDGE_FACTORS.get(method, ()):
      lr = methods.get(method).learning_rate * factor
      overrides = {**scale.overrides(), "method": method, "seed": 0, "speeds": "mixed",
                   "budget.tokens": scale.tokens, "outer.learning_rate": lr}
      runs.append(Run(f"authors/lr/{method}/x{factor:g}", "lr", "mixed", method, 0,
                      tuple(overrides.items())))
  return runs


# Delayed Nesterov at the best outer lr of its lr check (× 16 the authors' 0.07: seed 0 ended at
# 5.9172 against 6.5748, with × 8 5.9678 and × 32 6.2427), every paces, the token budget: whether
# HeLoCo still beats it when DN's outer lr is tuned here (RESULTS.md's claims; not their setting).
DN_TUNED_FACTOR = 16.0


def dn_tuned_learning_rate() -> float:
  """Delayed Nesterov's outer lr in ``dn_tuned_grid``: ``DN_TUNED_FACTOR`` × the authors'."""
  from heloco_jax.training import methods  # pylint: disable=g-import-not-at-top
  return methods.get("delayed_nesterov").learning_rate * DN_TUNED_FACTOR


def dn_tuned_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """The authors grid's Delayed Nesterov token runs at ``dn_tuned_learning_rate``."""
  lr = dn_tuned_learning_rate()
  return [Run(run.name.replace("authors/", "authors/dn_tuned/", 1), "dn_tuned", run.preset,
              run.method, run.seed, (*run.overrides, ("outer.learning_rate", lr)))
          for run in authors_grid(scale, seeds)
          if (run.table, run.method) == ("tokens", "delayed_nesterov")]


# PALSGD as its authors ran it (Hiroki11x/Pseudo-Asynchronous-LocalSGD, gptneo_8m/README.md):
# shared coins, p = 0.2, outer Nesterov lr 0.1, an IID split, and the pull η_ps·α/p = 0.05 of
# their example (AdamW α = 0.01, η_ps = 1); with this grid's α = 6e-4 that is η_ps = 0.05·p/α.
# DDP with and without its all-reduce overlapped with the backward pass (2/3 of a step, as
# PyTorch DDP); all-reduce c seconds against 1 s of compute per step.
COMM_RATIOS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)
PALSGD_PULL = 0.05
PALSGD_OUTER_LR = 0.1
DDP_OVERLAP = 2 / 3


def _palsgd_run(scale: Scale, seed: int, c: float, table: str, name: str, method: str,
                factor: int, changes: dict[str, Any]) -> Run:
  """One run of the PALSGD comparison: homogeneous, IID, all-reduce c, ``factor`` × the budget."""
  overrides = {**scale.overrides(), "method": method, "seed": seed, "speeds": "homogeneous",
               "data.partition": "iid", "comm.latency": c, "budget.tokens": factor * scale.tokens,
               "budget.eval_every_tokens": scale.eval_every_tokens // 4, **changes}
  return Run(f"{table}/{name}/seed{seed}", table, "homogeneous", name, seed,
             tuple(overrides.items()))


def _palsgd_authors(scale: Scale) -> dict[str, Any]:
  p = 0.2
  return {"inner.pseudo_sync_prob": p, "inner.palsgd_coins": "shared",
          "inner.pseudo_sync_rate": PALSGD_PULL * p / scale.inner_learning_rate,
          "outer.learning_rate": PALSGD_OUTER_LR}


def palsgd_c_grid(scale: Scale = PAPER, seeds: Sequence[int] | None = None) -> list[Run]:
  """DDP (plain, overlapped), DiLoCo and PALSGD over ``COMM_RATIOS``, IID, homogeneous.

  DDP reads the token budget, DiLoCo and PALSGD twice it (same schedule), so that their
  time to DDP's final loss can be measured where they need more tokens than DDP.
  """
  variants = (("ddp", "ddp", 1, {}), ("ddp_overlap", "ddp", 1, {"comm.ddp_overlap": DDP_OVERLAP}),
              ("diloco", "diloco", 2, {}), ("palsgd", "palsgd", 2, _palsgd_authors(scale)))
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    for c in COMM_RATIOS:
      for name, method, factor, changes in variants:
        if name == "ddp_overlap" and c == 0:
          continue  # nothing to hide: the plain DDP run
        runs.append(_palsgd_run(scale, seed, c, f"palsgd_c/c{c:g}", name, method, factor,
                                changes))
  return runs


# Why PALSGD misses DDP's loss (RESULTS.md): PALSGD at DiLoCo's outer lr (0.7) at every c, and
# DiLoCo at the PALSGD authors' (0.1) at one c; otherwise the palsgd_c runs (and tables).
PALSGD_WHY_C = 0.25
PALSGD_SWAPPED, DILOCO_SWAPPED = "palsgd_lr0.7", "diloco_lr0.1"  # the runs' names


def palsgd_why_grid(scale: Scale = PAPER, seeds: Sequence[int] | None = None) -> list[Run]:
  """``palsgd_c_grid``'s PALSGD at DiLoCo's outer lr over ``COMM_RATIOS``, and its DiLoCo at
  PALSGD's at c = ``PALSGD_WHY_C``: whether the outer lr is what keeps PALSGD from DDP's loss,
  and PALSGD's crossover with it."""
  from heloco_jax.training import methods  # pylint: disable=g-import-not-at-top
  diloco_lr = methods.get("diloco").learning_rate
  palsgd = {**_palsgd_authors(scale), "outer.learning_rate": diloco_lr}
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    for c in COMM_RATIOS:
      runs.append(_palsgd_run(scale, seed, c, f"palsgd_c/c{c:g}", PALSGD_SWAPPED, "palsgd", 2,
                              palsgd))
    runs.append(_palsgd_run(scale, seed, PALSGD_WHY_C, f"palsgd_c/c{PALSGD_WHY_C:g}",
                            DILOCO_SWAPPED, "diloco", 2, {"outer.learning_rate": PALSGD_OUTER_LR}))
  return runs


# Why HeLoCo trails synchronous DiLoCo at severe paces (RESULTS.md): the authors' inner cosine
# decay ends at each worker's own 2,000th step (their CosineScheduler holds 1e-6 after it), and
# at severe paces the fast worker takes ~7,900 steps in T, three quarters of them at 1e-6. These
# runs repeat HeLoCo's token run and synchronous DiLoCo's time run there with the decay spanning
# the fast worker's steps in T ("long_decay"), and with a constant inner lr ("no_decay");
# nothing else changes.
DECAY_WHY_PRESET = "severe"
DECAY_WHY_METHODS = ("heloco", "diloco")
DECAY_WHY_VARIANTS = ("long_decay", "no_decay")


def fastest_worker_steps(scale: Scale, preset: str, num_workers: int = 5) -> int:
  """The local steps the fastest worker takes in ``time_budget`` when no one waits."""
  seconds = clocks.seconds_per_step(preset, num_workers)
  return int(round(time_budget(scale, preset, num_workers) / seconds.min()))


def decay_why_changes(scale: Scale = AUTHORS) -> dict[str, dict[str, Any]]:
  """Variant -> its config changes: the decay over ``fastest_worker_steps``, or none at all."""
  return {"long_decay": {"inner.total_steps": fastest_worker_steps(scale, DECAY_WHY_PRESET)},
          "no_decay": {"inner.min_learning_rate_ratio": 1.0}}


def decay_why_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """``authors_grid``'s HeLoCo token run and synchronous DiLoCo time run at
  ``DECAY_WHY_PRESET``, in each of ``DECAY_WHY_VARIANTS`` (``decay_why_changes``)."""
  runs = []
  for run in authors_grid(scale, seeds):
    own_table = "time" if run.method == "diloco" else "tokens"
    if (run.preset, run.table) != (DECAY_WHY_PRESET, own_table) \
        or run.method not in DECAY_WHY_METHODS:
      continue
    for variant, changes in decay_why_changes(scale).items():
      overrides = {**dict(run.overrides), **changes}
      runs.append(Run(f"authors/{variant}/{run.table}/{run.preset}/{run.method}/seed{run.seed}",
                      variant, run.preset, run.method, run.seed, tuple(overrides.items())))
  return runs


def science_grid() -> list[Run]:
  """Issue 18's runs in the order they are worth having: seed by seed, so that an interrupted
  grid has whole seeds (the verdicts need three); then the one-seed lr check and Delayed
  Nesterov at the best lr it found."""
  runs = []
  for seed in AUTHORS.seeds:
    runs += (authors_grid(seeds=(seed,)) + palsgd_c_grid(seeds=(seed,))
             + palsgd_why_grid(seeds=(seed,)) + decay_why_grid(seeds=(seed,)))
  return runs + authors_lr_grid() + dn_tuned_grid()


GRIDS.update({
    "authors": authors_grid,
    "authors_lr": authors_lr_grid,
    "palsgd_c": palsgd_c_grid,
    "palsgd_why": palsgd_why_grid,
    "decay_why": decay_why_grid,
    "dn_tuned": dn_tuned_grid,
    "science": science_grid,
})
# Issue 18's grids: one RESULTS.md.
SCIENCE = ("authors", "authors_lr", "palsgd_c", "palsgd_why", "decay_why", "dn_tuned",
           "science")
SCALES.update({"authors": AUTHORS, "authors_lr": AUTHORS, "palsgd_c": PAPER, "palsgd_why": PAPER,
               "decay_why": AUTHORS, "dn_tuned": AUTHORS, "science": AUTHORS})


# Issue 36, "Science that survives a skeptic": runs that test the verdicts of issue 18's grids
# (science.py's module docstring has the verdict rule, fixed before these ran). All at severe
# and moderate paces, where the verdicts were closest, and all with per-step jitter:
#
# With ``jitter = 0`` every seed has the same arrival schedule (worker order, simulated times,
# staleness), so the seeds' loss oscillations were in phase (correlation +0.68) and "3 of 3
# seeds" mostly tested one phase. ``jitter = 0.2`` draws each step's time as t_i·(1 + 0.2·u),
# u ~ U(−1, 1) from each seed's own generator (``simulated.StepClock``): a per-step std of 11.5%
# (2.6% over an arrival's H = 20 steps), the mean paces unchanged. Measured on the clock alone
# (T of the authors' budget): at severe paces the four 15 s workers no longer arrive at the
# same instant (at jitter 0 they tie on every arrival) but spread by 20–40 s by the end, their
# last arrivals differ by up to 90 s across seeds, and about 30% of the arrival sequence's
# positions hold another worker than seed 0's; at moderate paces about 55%. A few % per step
# (0.05) moved those by a quarter as much, too little to shift the slow workers' arrivals
# against the evaluations (every 395 s at severe); more than 0.2 would start to change the
# paces' spread itself.
JITTER = 0.2
SKEPTIC_PRESETS = ("severe", "moderate")


def _skeptic(run: Run, kind: str, changes: dict[str, Any], jitter: float = JITTER) -> Run:
  """``run`` (an authors grid run) as ``skeptic/<kind>/...`` with ``jitter`` (none: 0) and
  ``changes``; its table is ``<kind>/<the run's table>`` so that the authors grid's tables
  never read it."""
  overrides = {**dict(run.overrides), **({"jitter": jitter} if jitter else {}), **changes}
  return Run(run.name.replace("authors/", f"skeptic/{kind}/", 1), f"{kind}/{run.table}",
             run.preset, run.method, run.seed, tuple(overrides.items()))


def _own_runs(scale: Scale, seeds: Sequence[int], presets: Sequence[str],
              methods: Sequence[str] = METHODS) -> list[Run]:
  """The authors grid's runs at ``presets`` that the claims read: the asynchronous methods'
  token runs (they are their time runs too) and synchronous DiLoCo's time runs (its token
  trajectory does not depend on the paces, nor on the clock's jitter)."""
  return [run for run in authors_grid(scale, seeds) if run.preset in presets
          and run.method in methods and run.table == ("time" if run.method == "diloco"
                                                      else "tokens")]


# The jitter grid's cells whose paired 95% CI crossed zero at 3 seeds (issue 36, item 2: "5
# seeds where a cell's CI crosses zero"): (preset, HeLoCo and its baseline) -> seeds 3 and 4.
# At 3 seeds: severe vs async Nesterov, window -0.01% [-2.30, +2.28]; every other cell's CI
# was above 0.
JITTER_UNCLEAR = (("severe", ("heloco", "async_nesterov")),)
MORE_SEEDS = (3, 4)


def jitter_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """Independent seeds (issue 36, item 2): the claims' runs at ``SKEPTIC_PRESETS`` with
  ``jitter = JITTER``, seed by seed (5 runs per preset and seed); then the runs of the
  ``JITTER_UNCLEAR`` cells at ``MORE_SEEDS`` (not with ``seeds`` given)."""
  runs = [_skeptic(run, "jitter", {}) for seed in (scale.seeds if seeds is None else seeds)
          for preset in SKEPTIC_PRESETS for run in _own_runs(scale, (seed,), (preset,))]
  more = [] if seeds is not None else [_skeptic(run, "jitter", {})
                                       for run in _unclear_runs(JITTER_UNCLEAR, scale)]
  return runs + more


def _unclear_runs(unclear: Sequence[tuple[str, Sequence[str]]], scale: Scale) -> list[Run]:
  """The claims' runs (``_own_runs``) of the ``unclear`` cells ((preset, methods)) at
  ``MORE_SEEDS``, for a grid to change as it changes its other seeds' runs."""
  return [run for seed in MORE_SEEDS for preset, methods in unclear
          for run in _own_runs(scale, (seed,), (preset,), methods)]


# Fair baselines (issue 36, item 3): every method's outer lr × these at each of
# ``SKEPTIC_PRESETS`` (× 1: ``jitter_grid``'s run), with the jitter, on seed 0. × 0.5 and × 2
# bracket × 1; where an edge wins, the next factor out (× 0.25, × 4, ...) joins that preset's
# and method's ``SKEPTIC_LR_EDGE_FACTORS`` until the best is bracketed. Delayed Nesterov starts
# at × 4 and × 16 too (the mixed-paces check found its best at × 16); at severe paces × 4 was
# the best of those (window loss 6.529; × 2 6.636, × 16 6.911), so × 8 joined, for factor-2
# steps around it (6.468, the best). MLA at severe paces: × 0.5 6.308 < × 1 6.481, × 2 far
# above, so × 0.25 (6.518: × 0.5 is the best). HeLoCo at severe paces likewise: × 0.5 6.292
# < × 1 6.437, × 2 far above (7.63 at half the budget), so × 0.25 (6.484: × 0.5 is the best).
# At moderate paces DN's × 8 is bracketed (6.084; × 4 6.306, × 16 6.239); MLA's × 0.5 6.054
# < × 1 6.061 (× 2 6.820) and HeLoCo's × 0.5 5.989 < × 1 6.000, so × 0.25 for both (6.334,
# 6.277: × 0.5 is the best of each); sync DiLoCo's × 1 is bracketed (5.626; × 0.5 5.807, × 2
# 5.721).
# Seeds 1 and 2 then run each (preset, method) at its seed-0 best only (``SKEPTIC_LR_BEST``,
# filled in once seed 0's sweep is in; × 1 needs no runs: the jitter grid's). Bracketing first
# halves the sweep (30 runs a seed instead of 46), which a 2-core CPU needs.
SKEPTIC_LR_FACTORS = (0.5, 2.0)
SKEPTIC_LR_EDGE_FACTORS = {  # (preset, method) -> factors beyond SKEPTIC_LR_FACTORS
    **{(preset, "delayed_nesterov"): (4.0, 8.0, 16.0) for preset in SKEPTIC_PRESETS},
    **{(preset, method): (0.25,) for preset in SKEPTIC_PRESETS for method in ("mla", "heloco")}}
# (preset, method) -> seed 0's best factor (``science.best_lr_results``), once bracketed.
SKEPTIC_LR_BEST: dict[tuple[str, str], float] = {
    ("severe", "async_nesterov"): 1.0, ("severe", "delayed_nesterov"): 8.0,
    ("severe", "mla"): 0.5, ("severe", "heloco"): 0.5, ("severe", "diloco"): 1.0,
    ("moderate", "async_nesterov"): 1.0, ("moderate", "delayed_nesterov"): 8.0,
    ("moderate", "mla"): 0.5, ("moderate", "heloco"): 0.5, ("moderate", "diloco"): 1.0}


def skeptic_lr_factors(preset: str, method: str) -> tuple[float, ...]:
  return tuple(sorted(SKEPTIC_LR_FACTORS + SKEPTIC_LR_EDGE_FACTORS.get((preset, method), ())))


# The lr bests' cells whose paired 95% CI crossed zero at 3 seeds, at ``MORE_SEEDS`` too as
# the jitter grid's: severe, HeLoCo × 0.5 vs MLA × 0.5, +0.49% [-0.30, +1.28] (their × 1
# counterparts are the jitter grid's; async Nesterov's best is × 1, whose seeds 3 and 4 it has).
LR_UNCLEAR = (("severe", ("heloco", "mla")),)


def lr_sweep_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """Each method's outer lr × ``skeptic_lr_factors`` at each of ``SKEPTIC_PRESETS`` on seed 0,
  and on the other seeds × its ``SKEPTIC_LR_BEST`` (none where that is × 1 or not known yet):
  its ``jitter_grid`` run with only ``outer.learning_rate`` changed, seed by seed; then the
  ``LR_UNCLEAR`` cells at their best on ``MORE_SEEDS`` (not with ``seeds`` given)."""
  def at(run: Run, factor: float) -> Run:
    from heloco_jax.training import methods  # pylint: disable=g-import-not-at-top
    swept = _skeptic(run, "lr", {"outer.learning_rate": methods.get(run.method).learning_rate
                                 * factor})
    return dataclasses.replace(
        swept, name=swept.name.replace(f"/{run.method}/", f"/{run.method}/x{factor:g}/"))

  def at_best(run: Run) -> list[Run]:  # × 1 is the jitter grid's run
    best = SKEPTIC_LR_BEST.get((run.preset, run.method), 1.0)
    return [at(run, best)] if best != 1.0 else []

  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    for preset in SKEPTIC_PRESETS:
      for run in _own_runs(scale, (seed,), (preset,)):
        runs += ([at(run, factor) for factor in skeptic_lr_factors(preset, run.method)]
                 if seed == 0 else at_best(run))
  more = [] if seeds is not None else [
      swept for run in _unclear_runs(LR_UNCLEAR, scale) for swept in at_best(run)]
  return runs + more


# The authors' vocabulary size (issue 36, item 4): a byte-level BPE of GPT-2's 50,257 ids
# trained on the corpus like the 2,048-id one (`heloco-jax corpus bpe`: every language without
# the last 10% of each), stored next to it; the model grows from 2.1M to 14.5M parameters (the
# untied embedding and head), as the authors' does.
VOCAB_50K = 50_257
# Tokenizer files in the corpus folder -> their ids (reproduce.py trains the missing ones).
CORPUS_VOCABS = {"tokenizer.json": AUTHORS_VOCAB, f"tokenizer_{VOCAB_50K}.json": VOCAB_50K}
VOCAB_PRESETS = ("severe", "mixed")  # the sync claim's paces and the authors' own mix
VOCAB_METHODS = ("async_nesterov", "mla", "heloco", "diloco")


def vocab_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """The authors grid's runs of ``VOCAB_METHODS`` at ``VOCAB_PRESETS`` (the asynchronous
  methods' token runs, synchronous DiLoCo's time runs and its one token run) with only the
  vocabulary changed to ``VOCAB_50K`` ids, seed by seed. Jitter stays 0 as in the authors grid,
  so that each run differs from its 2,048-id run in the vocabulary alone."""
  tokenizer = f"{CORPUS}/tokenizer_{VOCAB_50K}.json"
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    runs += [_skeptic(run, f"vocab{VOCAB_50K}", {"data.tokenizer": tokenizer}, jitter=0.0)
             for run in authors_grid(scale, (seed,)) if run.method in VOCAB_METHODS
             and (run.preset in VOCAB_PRESETS or (run.method, run.table) == ("diloco", "tokens"))]
  return runs


# Beyond the grid's languages (issue 36, item 6): the jitter grid's runs on five languages the
# grid does not use, one per worker as before (the fast worker at severe paces reads nl, as it
# read de), from their own corpus folder next to the grid's, with their own 2,048-id BPE
# trained on them the same way. Latin-script languages only (ru left out), like the grid's.
HELDOUT_LANGUAGES = "nl,pt,sv,pl,fi"
HELDOUT_SUFFIX = "_heldout"
# Corpus folders next to the grid's ({corpus}<suffix>) -> (languages, ids of their BPE).
EXTRA_CORPORA = {HELDOUT_SUFFIX: (HELDOUT_LANGUAGES, AUTHORS_VOCAB)}


# The held-out grid's cells whose paired 95% CI crossed zero at 3 seeds, at ``MORE_SEEDS`` too
# as the jitter grid's: moderate vs MLA +1.49% [-1.57, +4.55]; severe vs async Nesterov +0.22%
# [-2.03, +2.47], vs MLA +0.55% [-2.06, +3.16].
HELDOUT_UNCLEAR = (("moderate", ("heloco", "mla")),
                   ("severe", ("heloco", "async_nesterov", "mla")))


def heldout_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """``jitter_grid``'s runs on ``HELDOUT_LANGUAGES`` (corpus ``{corpus}_heldout`` and its
  own BPE), seed by seed; then the runs of the ``HELDOUT_UNCLEAR`` cells at ``MORE_SEEDS``
  (not with ``seeds`` given)."""
  folder = CORPUS + HELDOUT_SUFFIX
  changes = {"data.languages": HELDOUT_LANGUAGES, "data.path": folder,
             "data.tokenizer": f"{folder}/tokenizer.json"}
  runs = [_skeptic(run, "heldout", changes) for seed in (scale.seeds if seeds is None else seeds)
          for preset in SKEPTIC_PRESETS for run in _own_runs(scale, (seed,), (preset,))]
  more = [] if seeds is not None else [_skeptic(run, "heldout", changes)
                                       for run in _unclear_runs(HELDOUT_UNCLEAR, scale)]
  return runs + more


# PALSGD fairly (issue 36, item 5), at the palsgd_c grid's scale (homogeneous, IID):
#  * DDP tuned for its own run: its inner cosine decay over its own steps (it takes
#    tokens / (K·batch·context) = 781 of them; the palsgd_c runs decayed over 4,000 and ended
#    at 92% of the peak lr) and its lr × 1, √5 and 5 for its K = 5 times larger global batch
#    (square-root and linear scaling), at every c (its trajectory does not depend on c, its
#    time does), 3 seeds; × 10 and × 20 bracket the best: on seed 0 × 5 was the best of the
#    first three (final val loss 2.3167; √5: 2.3637, × 1: 2.4386; the palsgd_c DDP: 2.3928),
#    then × 10 beat it (2.2034);
#  * PALSGD's outer lr × pull swept at c = PALSGD_WHY_C (the two palsgd_c ones excluded); pull
#    0.2 joined when 0.1, the edge, reached the tuned DDP's loss first on seed 0 (at outer lr
#    0.7: 1,166 s; pull 0.05: 1,197 s; outer lr 1 and pull 0.1: 1,188 s); then (1, 0.2), an
#    edge in both, was first (1,130 s), so PALSGD_FAIR_EDGE's three join; they bracket it
#    ((1, 0.4): 1,166 s; outer lr 1.4 never reaches the target).
# Seeds 1 and 2 run DDP at every factor at c = 0 (its trajectory, so ``science.fair_ddp``
# picks on every seed: × 10, seed 0's best at 2.2034, ended at 2.4736 and 2.5205 on seeds 1
# and 2; × 5 at 2.3167, 2.1592, 2.1991 is the pick), DDP × PALSGD_FAIR_DDP_BEST (the pick) at
# the other c's, and PALSGD at PALSGD_FAIR_BEST (outer lr, pull; None until seed 0's sweep
# brackets it), as the lr sweeps do. The claims' PALSGD at every c is palsgd_c's (3 seeds
# already). 11 runs a seed instead of 40. Over 3 seeds the pick took 1,121 s to the tuned DDP's
# loss and palsgd_c's (0.7, 0.05) 1,070 s: seed 0's pick did not hold (RESULTS.md).
DDP_FAIR_LR_FACTORS = (1.0, math.sqrt(5), 5.0, 10.0, 20.0)
PALSGD_FAIR_OUTER_LRS = (0.1, 0.3, 0.7, 1.0)
PALSGD_FAIR_PULLS = (0.025, 0.05, 0.1, 0.2)
PALSGD_FAIR_EDGE = ((1.0, 0.4), (1.4, 0.2), (1.4, 0.4))
PALSGD_FAIR_DDP_BEST = 5.0
PALSGD_FAIR_BEST: tuple[float, float] | None = (1.0, 0.2)


def palsgd_fair_sweep() -> list[tuple[float, float]]:
  """Seed 0's PALSGD (outer lr, pull) at c = ``PALSGD_WHY_C``: the grid, then its edge."""
  return [(lr, pull) for lr in PALSGD_FAIR_OUTER_LRS for pull in PALSGD_FAIR_PULLS] + list(
      PALSGD_FAIR_EDGE)


def ddp_fair_name(factor: float) -> str:
  """The palsgd_fair grid's name of DDP at its inner lr × ``factor``, decayed over its own
  steps."""
  return f"ddp_own_decay_x{factor:.3g}"


def palsgd_fair_name(outer_lr: float, pull: float) -> str:
  """The palsgd_fair grid's name of PALSGD at ``outer_lr`` and ``pull``."""
  return f"palsgd_lr{outer_lr:g}_pull{pull:g}"


def ddp_own_steps(scale: Scale = PAPER, num_workers: int = 5) -> int:
  """The steps DDP takes in ``scale.tokens`` (each reads K·batch·context tokens)."""
  return scale.tokens // (num_workers * scale.batch_size * scale.context)


def palsgd_fair_grid(scale: Scale = PAPER, seeds: Sequence[int] | None = None) -> list[Run]:
  """Seed 0: DDP at each of ``DDP_FAIR_LR_FACTORS`` with its decay over ``ddp_own_steps`` at
  every c, then PALSGD at each of ``palsgd_fair_sweep`` not run by palsgd_c or palsgd_why;
  other seeds: DDP at each factor at c = 0, ``PALSGD_FAIR_DDP_BEST`` at the other c's and
  ``PALSGD_FAIR_BEST`` (names ``skeptic/palsgd_fair/c<c>/<variant>/seed<s>``)."""
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    variants = [(c, ddp_fair_name(factor), "ddp", 1,
                 {"inner.total_steps": ddp_own_steps(scale),
                  "inner.learning_rate": scale.inner_learning_rate * factor})
                for factor in DDP_FAIR_LR_FACTORS for c in COMM_RATIOS
                if seed == 0 or c == 0 or factor == PALSGD_FAIR_DDP_BEST]
    sweep = (palsgd_fair_sweep() if seed == 0
             else [PALSGD_FAIR_BEST] if PALSGD_FAIR_BEST else [])
    p = _palsgd_authors(scale)["inner.pseudo_sync_prob"]
    variants += [(PALSGD_WHY_C, palsgd_fair_name(lr, pull), "palsgd", 2,
                  {**_palsgd_authors(scale), "outer.learning_rate": lr,
                   "inner.pseudo_sync_rate": pull * p / scale.inner_learning_rate})
                 for lr, pull in sweep if pull != PALSGD_PULL or lr not in (PALSGD_OUTER_LR, 0.7)]
    for c, name, method, factor, changes in variants:
      run = _palsgd_run(scale, seed, c, f"palsgd_fair/c{c:g}", name, method, factor, changes)
      runs.append(dataclasses.replace(run, name="skeptic/" + run.name))
  return runs


def skeptic_grid() -> list[Run]:
  """Issue 36's runs, the most answer per core-hour first: the jittered claims' runs (the
  verdicts need 3 seeds); PALSGD fairly, all seeds (1–3 minutes a run); seeds 3 and 4 of the
  jittered cells whose CI crossed zero; the lr sweeps' seed 0 (where each method's best lr
  is); the held-out languages' seed 0; the 50k vocabulary's HeLoCo and sync DiLoCo at severe
  paces, all seeds (whether the sync verdict hinges on the vocabulary); the held-out
  languages' seeds 1 and 2; the lr sweeps' (each method at its best only); seeds 3 and 4 of
  the held-out cells and of the lr bests' cells whose CI crossed zero; then the rest of the
  vocabulary, last its synchronous DiLoCo token runs (no claim reads them). A 50k-vocabulary
  run costs about 7.5 times a 2,048-id one on this CPU (measured: experiments/README.md)."""
  rest = (1, 2)
  vocab = vocab_grid()
  sync_question = [r for r in vocab if r.preset == "severe" and r.method in ("heloco", "diloco")]
  no_claim = [r for r in vocab if r.table.endswith("tokens") and r.method == "diloco"]
  return (jitter_grid(seeds=AUTHORS.seeds) + palsgd_fair_grid()
          + [r for r in jitter_grid() if r.seed in MORE_SEEDS]
          + lr_sweep_grid(seeds=(0,)) + heldout_grid(seeds=(0,)) + sync_question
          + heldout_grid(seeds=rest) + lr_sweep_grid(seeds=rest)
          + [r for r in heldout_grid() if r.seed in MORE_SEEDS]
          + [r for r in lr_sweep_grid() if r.seed in MORE_SEEDS]
          + [r for r in vocab if r not in sync_question + no_claim] + no_claim)


GRIDS.update({"jitter": jitter_grid, "lr_sweep": lr_sweep_grid, "vocab": vocab_grid,
              "heldout": heldout_grid, "palsgd_fair": palsgd_fair_grid,
              "skeptic": skeptic_grid})
# Issue 36's grids (their RESULTS.md sections come later; the runner reports on the science
# family for now).
SKEPTIC = ("jitter", "lr_sweep", "vocab", "heldout", "palsgd_fair", "skeptic")
SCALES.update({name: AUTHORS for name in SKEPTIC})


# Issue 34 (streaming and compression), at a small scale on the shipped synthetic languages (no
# corpus to build): a 137k-parameter GPT (byte vocabulary), 5 workers, H = 20, 204,800 tokens
# (8 DiLoCo rounds at homogeneous speeds), 3 seeds.
STREAMING = Scale(d_model=64, num_layers=2, num_heads=4, context=64, batch_size=4,
                  inner_steps=20, tokens=204_800, eval_every_tokens=25_600,
                  inner_total_steps=2_000, inner_learning_rate=3e-3, seeds=(0, 1, 2),
                  data=(("data.source", "synthetic"),))
# A link on which θ in float32 (136,961 parameters, 547,844 bytes) takes 4 s each way: four
# inner steps at speed 1.
STREAMING_BANDWIDTH = 136_961.0
STREAMING_FRAGMENTS = (1, 2, 4)
STREAMING_OVERLAP = {"streaming.overlap_steps": 2, "streaming.alpha": 0.5}
# (name, config changes): what each worker sends.
COMPRESSIONS = (
    ("fp32", {}), ("bf16", {"compression.kind": "bf16"}), ("int8", {"compression.kind": "int8"}),
    ("int4", {"compression.kind": "int4"}),
    ("int4_ef", {"compression.kind": "int4", "compression.error_feedback": True}),
    ("int2", {"compression.kind": "int2"}),
    ("int2_ef", {"compression.kind": "int2", "compression.error_feedback": True}),
    ("top1pct_ef", {"compression.kind": "top_k", "compression.fraction": 0.01,
                    "compression.error_feedback": True}))
# Which paces each method of the compression question runs at: synchronous DiLoCo at equal
# speeds, HeLoCo where it is meant to work (severe).
COMPRESSION_PRESETS = {"diloco": "homogeneous", "heloco": "severe"}
BANDWIDTH_PRESET = "mild"
# (name, method, config changes) of the bandwidth-limited question (all with the link above).
BANDWIDTH_VARIANTS = (
    ("diloco", "diloco", {}),
    ("streaming_p4", "diloco", {"streaming.fragments": 4, **STREAMING_OVERLAP}),
    ("heloco", "heloco", {}),
    ("heloco_p4_int8_ef", "heloco", {"streaming.fragments": 4, **STREAMING_OVERLAP,
                                     "compression.kind": "int8",
                                     "compression.error_feedback": True}))


def streaming_grid(scale: Scale = STREAMING, seeds: Sequence[int] | None = None) -> list[Run]:
  """Issue 34's questions seed by seed (every question's seed 0 first): Streaming DiLoCo's
  fragments at equal tokens ("fragments"), the compressors for DiLoCo and HeLoCo at equal
  tokens ("compression"), and time on a bandwidth-limited link ("bandwidth")."""
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    base = {**scale.overrides(), "seed": seed}
    tokens = {**base, "budget.tokens": scale.tokens}
    for p in STREAMING_FRAGMENTS:
      runs.append(Run(f"streaming/fragments/p{p}/diloco/seed{seed}", "fragments",
                      "homogeneous", "diloco", seed, tuple({
                          **tokens, "method": "diloco", "speeds": "homogeneous",
                          "streaming.fragments": p}.items())))
    runs.append(Run(f"streaming/fragments/p4_overlap/diloco/seed{seed}", "fragments",
                    "homogeneous", "diloco", seed, tuple({
                        **tokens, "method": "diloco", "speeds": "homogeneous",
                        "streaming.fragments": 4, **STREAMING_OVERLAP}.items())))
    for method, preset in COMPRESSION_PRESETS.items():
      for name, changes in COMPRESSIONS:
        runs.append(Run(f"streaming/compression/{name}/{method}/seed{seed}", "compression",
                        preset, method, seed, tuple({
                            **tokens, "method": method, "speeds": preset, **changes}.items())))
    seconds = time_budget(scale, BANDWIDTH_PRESET)
    for name, method, changes in BANDWIDTH_VARIANTS:
      runs.append(Run(f"streaming/bandwidth/{name}/{method}/seed{seed}", "bandwidth",
                      BANDWIDTH_PRESET, method, seed, tuple({
                          **base, "method": method, "speeds": BANDWIDTH_PRESET,
                          "budget.tokens": 0, "budget.sim_seconds": seconds,
                          "comm.bandwidth": STREAMING_BANDWIDTH, **changes}.items())))
  return runs


GRIDS["streaming"] = streaming_grid
SCALES["streaming"] = STREAMING


# Issue 35: CGAD at the authors' setup. Its Adam step moves each coordinate by about η per
# arrival, so η = 1e-2 (CGAD_BASE_LR: the registry's default until 2026-11-26, best at the
# streaming grid's scale, whose inner lr is 15 times the authors' 2e-4) is likely too large
# here: this one-seed check (mixed paces, the token budget, as ``authors_lr``) picks the η of
# the later CGAD grid (its token runs, all paces, 3 seeds, against HeLoCo, MLA, async
# Nesterov and DN at both budgets). The first two (η = 3e-4: 5.936, 1e-3: 6.129 final val
# loss) put the best at the low edge: 0.01 and 0.003 extend it.
CGAD_LR_FACTORS = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
# η the CGAD grids' factors multiply, and the chaos grid's CGAD runs use (the registry's is
# 1e-3 since: ALGORITHMS.md, "CGAD").
CGAD_BASE_LR = 1e-2


def cgad_lr_grid(scale: Scale = AUTHORS) -> list[Run]:
  """CGAD's outer lr × ``CGAD_LR_FACTORS`` of ``CGAD_BASE_LR``, mixed paces, seed 0, token
  budget."""
  runs = []
  for factor in CGAD_LR_FACTORS:
    lr = CGAD_BASE_LR * factor
    overrides = {**scale.overrides(), "method": "cgad", "seed": 0, "speeds": "mixed",
                 "budget.tokens": scale.tokens, "outer.learning_rate": lr}
    runs.append(Run(f"authors/lr/cgad/x{factor:g}", "lr", "mixed", "cgad", 0,
                    tuple(overrides.items())))
  return runs


GRIDS["cgad_lr"] = cgad_lr_grid
SCALES["cgad_lr"] = AUTHORS
# CGAD's η in the CGAD grid: × this CGAD_BASE_LR, the best of ``cgad_lr`` (final val
# loss, mixed paces, seed 0): × 0.003 6.983, × 0.01 6.463, × 0.03 (3e-4) 5.936, × 0.1 6.129,
# × 1 8.847; bracketed (× 0.3 ran after the CGAD grid).
CGAD_TUNED_FACTOR = 0.03


def cgad_learning_rate() -> float:
  """CGAD's outer lr in ``cgad_grid``: ``CGAD_TUNED_FACTOR`` × ``CGAD_BASE_LR``."""
  return CGAD_BASE_LR * CGAD_TUNED_FACTOR


def cgad_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """CGAD's token runs at every pace of the authors grid (the time budget reads them, as it
  reads the other asynchronous methods'), at ``cgad_learning_rate``."""
  lr = cgad_learning_rate()
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    for preset in AUTHORS_PRESETS:
      overrides = {**scale.overrides(), "method": "cgad", "seed": seed, "speeds": preset,
                   "budget.tokens": scale.tokens, "budget.sim_seconds": 0.0,
                   "outer.learning_rate": lr}
      runs.append(Run(f"authors/tokens/{preset}/cgad/seed{seed}", "tokens", preset, "cgad",
                      seed, tuple(overrides.items())))
  return runs


GRIDS["cgad"] = cgad_grid
SCALES["cgad"] = AUTHORS


# Issue 35's chaos harness: the streaming grid's model and data, mild paces, a time budget in
# which non-waiting workers read 409,600 tokens (400 simulated s), and the same seeded failure
# schedule for every method of a seed: each worker fails CHAOS_FAILURES times per budget on
# average and stays away CHAOS_DOWNTIME of it (``chaos.rate``, ``chaos.downtime``).
CHAOS = dataclasses.replace(STREAMING, tokens=409_600)
CHAOS_PRESET = "mild"
CHAOS_METHODS = ("ddp", "diloco", "async_nesterov", "mla", "heloco", "cgad")
CHAOS_FAILURES = 2.0
CHAOS_DOWNTIME = 0.1
# Decoupled DiLoCo's merge: a quorum of 2 (or what arrived 10 s after a group's first
# arrival: half a fast worker's dispatch), a grace window of half the mean gap, token weights.
CHAOS_SYNCER = {"syncer.quorum": 2, "syncer.timeout": 10.0, "syncer.adaptive_grace": 0.5,
                "syncer.weights": "tokens"}
# (condition, config changes, failures, asynchronous methods only); undisturbed_syncer
# separates what the syncer changes by itself from what it saves under failures.
CHAOS_CONDITIONS = (("undisturbed", {}, False, False), ("failures", {}, True, False),
                    ("undisturbed_syncer", CHAOS_SYNCER, False, True),
                    ("failures_syncer", CHAOS_SYNCER, True, True))


def chaos_grid(scale: Scale = CHAOS, seeds: Sequence[int] | None = None) -> list[Run]:
  """Every method of ``CHAOS_METHODS`` undisturbed and under the failure schedule (the
  asynchronous ones also both with ``CHAOS_SYNCER``), at equal simulated time, seed by
  seed."""
  from heloco_jax.training import methods  # pylint: disable=g-import-not-at-top
  seconds = time_budget(scale, CHAOS_PRESET)
  failures = {"chaos.rate": CHAOS_FAILURES / seconds, "chaos.downtime": CHAOS_DOWNTIME * seconds}
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    for method in CHAOS_METHODS:
      for condition, changes, failing, asynchronous_only in CHAOS_CONDITIONS:
        if asynchronous_only and methods.get(method).synchrony != "async":
          continue
        runs.append(Run(f"chaos/{condition}/{method}/seed{seed}", condition, CHAOS_PRESET,
                        method, seed, tuple({
                            **scale.overrides(), "method": method, "seed": seed,
                            "speeds": CHAOS_PRESET, "budget.tokens": 0,
                            "budget.sim_seconds": seconds,
                            **({"outer.learning_rate": CGAD_BASE_LR} if method == "cgad"
                               else {}),
                            **(failures if failing else {}), **changes}.items())))
  return runs


GRIDS["chaos"] = chaos_grid
SCALES["chaos"] = CHAOS
ISSUE35 = ("cgad_lr", "cgad", "chaos")


# Issue 60, item 1: symmetric seeds. Every cell of the authors'-setting claims rows (the
# authors grid's claims, CGAD's, and Delayed Nesterov at its tuned lr), of the jitter rows
# and of the best-lr rows gets seeds 3 and 4, chosen on 27 Nov before these runs and for all
# cells alike (the rows' earlier seeds 3 and 4 ran only where a cell's CI crossed zero, which
# biases a row towards "better"). The held-out and 50,257-id rows stay at 3 seeds, every
# cell: their verdicts read the seeds all of a row's cells have (``science.row_seeds``), so
# the held-out cells' seeds 3 and 4 are listed, not read.
SYMMETRIC_SEEDS = (3, 4)
# The authors grid's paces, the least settled cells first: severe (two cells' CIs cross 0),
# then by the narrowest CI of a cell at 3 seeds (mild vs MLA [+0.68, +3.56], moderate vs
# async Nesterov [+1.14, +5.64], homogeneous vs MLA [+1.42, +3.33], mixed vs MLA [+1.64,
# +3.11]).
SYMMETRIC_PRESETS = ("severe", "mild", "moderate", "homogeneous", "mixed")


def symmetric_grid(scale: Scale = AUTHORS) -> list[Run]:
  """Seeds ``SYMMETRIC_SEEDS`` of every claims run of the jitter, best-lr and authors'-setting
  rows, the most informative first: the jitter and best-lr runs (whose rows had the closest
  cells), seed by seed and severe before moderate; then the authors grid's claims runs (the
  asynchronous methods' token runs at every paces, synchronous DiLoCo's time run at severe
  paces: the loss tables' other synchronous runs are no claim's), seed by seed in
  ``SYMMETRIC_PRESETS``' order; then CGAD's and Delayed Nesterov's at its tuned lr (every
  cell of theirs was better by a wide margin). Runs that have a digest already (the earlier
  conditional seeds 3 and 4) are skipped by the runner."""
  runs = []
  for seed in SYMMETRIC_SEEDS:
    for preset in SKEPTIC_PRESETS:
      runs += [r for r in jitter_grid(scale, (seed,)) + lr_sweep_grid(scale, (seed,))
               if r.preset == preset]
  for seed in SYMMETRIC_SEEDS:
    for preset in SYMMETRIC_PRESETS:
      runs += [r for r in _own_runs(scale, (seed,), (preset,))
               if r.method != "diloco" or preset == DECAY_WHY_PRESET]
  for seed in SYMMETRIC_SEEDS:
    runs += cgad_grid(scale, (seed,)) + dn_tuned_grid(scale, (seed,))
  return runs


# Issue 60, item 5: a step up in scale, for a GPU. The authors' harness (H = 20, 5 workers,
# inner AdamW 2e-4 with a fresh state per dispatch and the cosine decay over each worker's
# share of the steps, the outer rules at the authors' lrs) with GPT d_model 512, 8 layers, 8
# heads, context 256 and the claims' own 2,048-id BPE: 27.4M parameters (12.9× the 2.1M of
# every claim so far; the transformer blocks 16×), and 7,000 local steps of 16 × 256 tokens,
# 28.7M tokens: ≥ 1 token per parameter. Severe and mixed paces, jitter 0.2 (independent
# seeds), HeLoCo, MLA, async Nesterov (token runs) and synchronous DiLoCo (its time runs), 3
# seeds: 24 runs, each committing its digest; ``science.VARIANTS`` reports its rows with their
# seeds as they land. Why this size (changed on 2026-11-29, before any scale run, from d_model
# 512 with the 50,257-id BPE, 76.9M parameters and 81.9M tokens): the corpus holds 5.0M tokens
# at 2,048 ids (about 1M per language; 3.3M at 50,257 ids), so the data, not the GPU, bounds
# the step. The 50,257-id design spent two thirds of its parameters on the vocabulary (its
# blocks were this design's), read each language about 25 times and cost 5.3× this design's
# FLOPs; this one reads each worker's language 5.1 to 6.4 times (0.89-1.12M tokens each),
# which RESULTS.md says next to the rows, and keeps the claims' tokenizer and corpus.
SCALE_PREFIX = "scale/"
SCALE = Scale(
    d_model=512, num_layers=8, num_heads=8, context=256, batch_size=16, inner_steps=20,
    tokens=7_000 * 16 * 256, eval_every_tokens=7_000 * 16 * 256 // 20,
    inner_total_steps=7_000 // 5, inner_learning_rate=2e-4, seeds=(0, 1, 2), data=AUTHORS.data,
    # bfloat16 matmuls (float32 parameters and outer step): the inner loop 3.2x float32's on
    # an H200 (docs/BENCHMARKS.md), set before any scale run (none had run on 2026-11-29)
    extra=AUTHORS.extra + (("model.compute_dtype", "bfloat16"),))
SCALE_PRESETS = ("severe", "mixed")
SCALE_METHODS = ("async_nesterov", "mla", "heloco", "diloco")


def scale_params(scale: Scale = SCALE, vocab: int = AUTHORS_VOCAB) -> int:
  """The GPT's parameters at ``scale`` (heloco_jax.lm.model: learned positions, pre-LayerNorm,
  MLP of width 4·d_model, untied head, biases but the QKV projection's;
  ``tests/test_experiments.py`` checks it against the model)."""
  d, layers = scale.d_model, scale.num_layers
  per_layer = 4 * d + 3 * d * d + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
  return vocab * d + scale.context * d + layers * per_layer + 2 * d + d * vocab + vocab


def scale_grid(scale: Scale = SCALE, seeds: Sequence[int] | None = None) -> list[Run]:
  """``SCALE_METHODS``' claims runs (``_own_runs``) at ``SCALE_PRESETS`` with jitter
  ``JITTER``, seed by seed, named ``scale/<table>/<preset>/<method>/seed<s>``."""
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    for run in _own_runs(scale, (seed,), SCALE_PRESETS, SCALE_METHODS):
      overrides = {**dict(run.overrides), "jitter": JITTER}
      runs.append(Run(run.name.replace("authors/", SCALE_PREFIX, 1), f"scale/{run.table}",
                      run.preset, run.method, run.seed, tuple(overrides.items())))
  return runs


GRIDS.update({"symmetric": symmetric_grid, "scale": scale_grid})
SCALES.update({"symmetric": AUTHORS, "scale": SCALE})
ISSUE60 = ("symmetric", "scale")


# Issue 81, item 1: a step up in scale on this CPU. The authors' harness (``AUTHORS``: H = 20, 5
# workers, their depth of 8 layers and 4 heads, context 128, 10,000 local steps of 2 × 128
# tokens, the claims' 2,048-id BPE) with the transformer body grown 4×: d_model 256 (the
# blocks' 12·d²·L parameters 6.3M against 1.6M; 7.4M parameters in all against 2.1M). Mixed
# and severe paces, jitter 0.2, HeLoCo, MLA, async Nesterov (token runs) and synchronous
# DiLoCo (its time runs), seed by seed (3 seeds, 5 where time allows), one core: decided on
# 2026-12-02 before any run of it.
BODY_PREFIX = "body/"
BODY = dataclasses.replace(AUTHORS, d_model=256)
BODY_PRESETS = ("mixed", "severe")
BODY_METHODS = ("heloco", "async_nesterov", "mla", "diloco")
BODY_MORE_SEEDS = (3, 4)


def body_grid(scale: Scale = BODY, seeds: Sequence[int] | None = None) -> list[Run]:
  """``BODY_METHODS``' claims runs (``_own_runs``) at ``BODY_PRESETS`` with jitter ``JITTER``,
  seed by seed (seeds 0–2, then ``BODY_MORE_SEEDS``), named
  ``body/<table>/<preset>/<method>/seed<s>``."""
  runs = []
  for seed in ((*scale.seeds, *BODY_MORE_SEEDS) if seeds is None else seeds):
    for preset in BODY_PRESETS:
      for run in _own_runs(scale, (seed,), (preset,), BODY_METHODS):
        overrides = {**dict(run.overrides), "jitter": JITTER}
        runs.append(Run(run.name.replace("authors/", BODY_PREFIX, 1), f"body/{run.table}",
                        run.preset, run.method, run.seed, tuple(overrides.items())))
  return runs


GRIDS["body"] = body_grid
SCALES["body"] = BODY


# Issue 81, item 2: PALSGD against DDP at its paper's small size, decided on 2026-12-02 before
# any run of it. The body grid's model (7.4M parameters: GPT-Neo-8M has 8.05M, most of them its
# 50,257-id embedding at d_model 128, 8 layers; this one has the same depth at d_model 256 and
# the claims' 2,048-id BPE, its parameters in the blocks), PALSGD's setting as in palsgd_c:
# homogeneous workers, an IID split, all-reduce c = ``PALSGD8M_C`` s against 1 s of compute per
# step, no jitter, K = 5, H = 20, AdamW inner state kept (its authors': a worker keeps its
# optimizer). DDP reads the token budget (2,000 steps of 5 × 2 × 128 tokens) with its cosine
# decay over its own steps; PALSGD reads twice it (time to DDP's loss may need more) with its
# decay over its own 4,000 local steps. Both tuned by one procedure on the same seeds (0, 1,
# 2), three candidates each, each picked by what the claim reads of it: DDP's inner lr factor
# by the lowest mean final validation loss (its loss is the target), PALSGD's (outer lr, pull)
# by the shortest mean time to each seed's tuned-DDP final loss (inf where a seed never
# reaches it). Then both picks run seeds 3 and 4. The claim: per seed, PALSGD's speedup
# (t_DDP − t_PALSGD) / t_DDP over the 5 seeds, paired 95% CI, the claims table's rule (a seed
# whose PALSGD never reaches the target counts at its run's end, a bound in PALSGD's favour).
# About 28 min a DDP run and 56 min a PALSGD run on one core of this machine: 15.4 h in all.
# Amended on 2026-12-02 (session 44), after seed 0's three DDP runs and before any PALSGD run:
# × √5 was lowest there by 0.58 nats (3.680, against 4.258 at × 5 and 4.298 at × 10), at the
# candidates' lower edge, so × 1 (each worker's own inner lr) joins them. A better-tuned DDP
# is a harder target for PALSGD, never an easier one.
PALSGD8M = dataclasses.replace(BODY, eval_every_tokens=BODY.tokens // 40)
PALSGD8M_C = PALSGD_WHY_C
PALSGD8M_DDP_FACTORS = (1.0, math.sqrt(5), 5.0, 10.0)
PALSGD8M_CANDIDATES = ((0.1, 0.05), (0.7, 0.05), (1.0, 0.2))  # (outer lr, pull)
PALSGD8M_MORE_SEEDS = (3, 4)
# The picks, by the rule above from seeds 0-2's digests (None until they have all landed;
# tests/test_experiments.py checks them against the digests). DDP's, set on 2026-12-04 when its
# 12 tuning runs had landed: × √5, mean final loss 3.685 over seeds 0-2 (× 1 3.911, × 10 4.139,
# × 5 4.308).
PALSGD8M_DDP_BEST: float | None = math.sqrt(5)
# PALSGD's, set on 2026-12-04 when its 9 tuning runs had landed: (outer lr 1, pull 0.2), the
# only candidate that reached each seed's tuned-DDP final loss on all three seeds (mean 2,820 s;
# (0.7, 0.05) reached it on 2 of 3 seeds, (0.1, 0.05) on none).
PALSGD8M_BEST: tuple[float, float] | None = (1.0, 0.2)


def palsgd8m_run(scale: Scale, seed: int, method: str, name: str,
                 changes: dict[str, Any]) -> Run:
  """One run of the PALSGD 8M comparison (above), named ``palsgd8m/c<c>/<name>/seed<s>``."""
  factor = 1 if method == "ddp" else 2
  steps = factor * ddp_own_steps(scale)
  overrides = {**scale.overrides(), "method": method, "seed": seed, "speeds": "homogeneous",
               "data.partition": "iid", "comm.latency": PALSGD8M_C,
               "budget.tokens": factor * scale.tokens, "inner.total_steps": steps,
               "inner.reset_optimizer": False, **changes}
  table = f"palsgd8m/c{PALSGD8M_C:g}"
  return Run(f"{table}/{name}/seed{seed}", table, "homogeneous", name, seed,
             tuple(overrides.items()))


def palsgd8m_grid(scale: Scale = PALSGD8M, seeds: Sequence[int] | None = None) -> list[Run]:
  """Seeds 0-2: DDP at each of ``PALSGD8M_DDP_FACTORS``, then PALSGD at each of
  ``PALSGD8M_CANDIDATES``; then ``PALSGD8M_MORE_SEEDS`` at the picks (when known)."""
  p = _palsgd_authors(scale)["inner.pseudo_sync_prob"]

  def ddp(seed, factor):
    return palsgd8m_run(scale, seed, "ddp", ddp_fair_name(factor),
                        {"inner.learning_rate": scale.inner_learning_rate * factor})

  def palsgd(seed, lr, pull):
    return palsgd8m_run(scale, seed, "palsgd", palsgd_fair_name(lr, pull), {
        **_palsgd_authors(scale), "outer.learning_rate": lr,
        "inner.pseudo_sync_rate": pull * p / scale.inner_learning_rate})
  runs = []
  for seed in (scale.seeds if seeds is None else seeds):
    runs += [ddp(seed, f) for f in PALSGD8M_DDP_FACTORS]
    runs += [palsgd(seed, lr, pull) for lr, pull in PALSGD8M_CANDIDATES]
  for seed in (PALSGD8M_MORE_SEEDS if seeds is None else ()):
    runs += [ddp(seed, PALSGD8M_DDP_BEST)] if PALSGD8M_DDP_BEST else []
    runs += [palsgd(seed, *PALSGD8M_BEST)] if PALSGD8M_BEST else []
  return runs


GRIDS["palsgd8m"] = palsgd8m_grid
SCALES["palsgd8m"] = PALSGD8M
ISSUE81 = ("body", "palsgd8m")


# Issue 80, item 4. (a) Faulty workers on the science model
# (``AUTHORS``: the authors' harness, 10,000 local steps of 2 × 128 tokens in all), f = 1 of 6
# and 2 of 8 workers faulty (``chaos.faulty``: workers 0 and 1, the fastest at mild paces,
# whose arrivals come most often), each behaviour of ``FAULTY_BEHAVIOURS`` and no fault at all
# (what a robust rule costs when nobody is faulty), × every rule that applies to a method:
# diloco's rounds take the peer rules; heloco and mla take the mean and the screen on single
# arrivals and the peer rules in quorum groups (quorum ``FAULTY_QUORUM``: a trimmed mean of f
# needs f < q/2; at q = 2f + 1 it is the median, one run for both), with the mean at that
# quorum too, so that a rule's effect is read at its own quorum. Mild paces, jitter 0.2
# (independent seeds), the cosine decay over each worker's share of the steps (10,000 / K, as
# the authors' 2,000 at K = 5), 3 seeds.
FAULTY_WORKERS = ((6, 1), (8, 2))  # (K, f): workers 0 … f − 1 are faulty
FAULTY_BEHAVIOURS = (("clean", ""), ("sign", "sign"), ("scale10", "scale=10"),
                     ("noise", "noise=1"))
FAULTY_METHODS = ("diloco", "heloco", "mla")
FAULTY_PRESET = "mild"
FAULTY_QUORUM = {6: 3, 8: 5}
FAULTY_SCREEN = "screen(norm=2.0)"  # the norm screen of docs/ALGORITHMS.md's measured table
# τ of centered clipping is absolute (a radius in Δ's units): 1.0, the factory's default, is
# not tuned to this model (honest Δ norms here are O(1)-O(10)).
FAULTY_CENTERED_CLIP = "centered_clip(tau=1.0, iters=3)"


def trimmed_is_median(f: int, peers: int) -> bool:
  """Whether ``trimmed_mean(f)`` over at most ``peers`` arrivals is ``median()`` bit for bit:
  with n ≤ 2f + 2 both keep the middle one or two values (docs/ALGORITHMS.md, "Aggregation")."""
  return peers <= 2 * f + 2


def faulty_rules(method: str, num_workers: int, f: int) -> tuple[tuple[str, str, int], ...]:
  """(name, ``syncer.aggregate``, ``syncer.quorum``) of every rule ``method`` takes; a median
  that ``trimmed_is_median`` (the quorum groups' here: q = 2f + 1) is the trimmed mean's run."""
  peers = (("trimmed_mean", f"trimmed_mean(f={f})"), ("median", "median()"),
           ("centered_clip", FAULTY_CENTERED_CLIP))
  if method == "diloco":
    return (("mean", "mean", 1),) + tuple((name, rule, 1) for name, rule in peers)
  q = FAULTY_QUORUM[num_workers]
  return (("mean", "mean", 1), ("screen", FAULTY_SCREEN, 1), (f"mean_q{q}", "mean", q)) + tuple(
      (f"{name}_q{q}", rule, q) for name, rule in peers
      if not (name == "median" and trimmed_is_median(f, q)))


def faulty_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """(K, f) by (K, f), then seed by seed: behaviour (clean first) × ``FAULTY_METHODS`` × rule,
  named ``faulty/K<K>f<f>/<behaviour>/<method>/<rule>/seed<s>``; the table is
  ``faulty/K<K>f<f>/<behaviour>``. f = 1 of 6 reaches its verdicts (3 seeds, 168 runs, about 28
  core-hours at the 601 s a run of its first 50 on the 2-core Intel Xeon) before 2 of 8 starts."""
  runs = []
  for num_workers, f in FAULTY_WORKERS:
    for seed in (scale.seeds if seeds is None else seeds):
      for behaviour, spec in FAULTY_BEHAVIOURS:
        faulty = ",".join(f"{w}:{spec}" for w in range(f)) if spec else ""
        for method in FAULTY_METHODS:
          for rule_name, rule, quorum in faulty_rules(method, num_workers, f):
            overrides = {**scale.overrides(), "method": method, "seed": seed,
                         "speeds": FAULTY_PRESET, "num_workers": num_workers,
                         "inner.total_steps": 10_000 // num_workers,
                         "budget.tokens": scale.tokens, "budget.sim_seconds": 0.0,
                         "jitter": JITTER, "chaos.faulty": faulty,
                         "syncer.aggregate": rule, "syncer.quorum": quorum}
            table = f"faulty/K{num_workers}f{f}/{behaviour}"
            runs.append(Run(f"{table}/{method}/{rule_name}/seed{seed}", table, FAULTY_PRESET,
                            method, seed, tuple(overrides.items())))
  return runs


# (b) HeLoCo's merge order under a quorum (``outer.merge_order``): merge-then-correct (the
# default, the authors' Decoupled HeLoCo) against correct-then-merge at quorum 2 and 3, at the
# authors' paces (``AUTHORS_PRESETS``), jitter 0.2, 5 seeds, the token budget; the verdict rule
# is the claims table's (science.py's module docstring).
MERGE_ORDERS = ("merge_then_correct", "correct_then_merge")
MERGE_QUORUMS = (2, 3)
MERGE_SEEDS = (0, 1, 2, 3, 4)


def merge_order_grid(scale: Scale = AUTHORS, seeds: Sequence[int] | None = None) -> list[Run]:
  """Seed by seed: quorum × preset × merge order, heloco, named
  ``merge_order/q<q>/<preset>/<order>/seed<s>``; the table is ``merge_order/q<q>/<order>``."""
  runs = []
  for seed in (MERGE_SEEDS if seeds is None else seeds):
    for quorum in MERGE_QUORUMS:
      for preset in AUTHORS_PRESETS:
        for order in MERGE_ORDERS:
          overrides = {**scale.overrides(), "method": "heloco", "seed": seed, "speeds": preset,
                       "budget.tokens": scale.tokens, "budget.sim_seconds": 0.0,
                       "jitter": JITTER, "syncer.quorum": quorum, "outer.merge_order": order}
          runs.append(Run(f"merge_order/q{quorum}/{preset}/{order}/seed{seed}",
                          f"merge_order/q{quorum}/{order}", preset, "heloco", seed,
                          tuple(overrides.items())))
  return runs


GRIDS.update({"faulty": faulty_grid, "merge_order": merge_order_grid})
SCALES.update({"faulty": AUTHORS, "merge_order": AUTHORS})
ISSUE80 = ("faulty", "merge_order")
# The grids one RESULTS.md (experiments/RESULTS.md) reports: any of their runs or
# ``--report-only`` commands rewrites all of it (``family``).
ONE_REPORT = SCIENCE + SKEPTIC + ("streaming",) + ISSUE35 + ISSUE60 + ISSUE81 + ISSUE80
