# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Staleness effects: speeds, H, K, data skew and the outer rule
#
# This notebook runs small simulations of asynchronous DiLoCo-style training with `heloco_jax`
# and shows how **staleness** arises and what it does to training. Change the knobs in the
# **parameters** cell below and run all cells; with the defaults everything takes about 40
# seconds on 2 CPU cores (37 s measured, compilation included), and the full version
# (`FULL = True`: 500k tokens per run, 3 seeds) about 2.5 minutes. The outputs committed with the
# notebook are those of the defaults; `notebooks/staleness_effects.py` is the same notebook as a
# script (jupytext), for readable diffs.
#
# **Staleness.** In asynchronous methods (`async_nesterov`, `delayed_nesterov`, `mla`, `heloco`)
# the server applies one outer update per arriving worker and re-dispatches that worker at once,
# with no barrier. A worker dispatched at server version $s$ that arrives at version $v$ has
# staleness $\tau = v - s$: the number of other workers' updates applied while it computed its
# $H$ inner steps. Its pseudo-gradient $\Delta = \bar\theta - \theta_H$ (start minus end) was
# computed on a model $\tau$ updates old. Synchronous methods (`diloco`, `local_sgd`, `palsgd`,
# `ddp`) have $\tau = 0$ but wait for the slowest worker every round.
#
# **The knobs.**
#
# | knob | what it changes |
# | --- | --- |
# | `SPEEDS` | seconds per inner step of each worker: a preset (`homogeneous` 1,1,1,1,1; `mild` 1,1,1,2,2; `moderate` 1,6,6,6,6; `severe` 1,15,15,15,15; `mixed` 1,2,3,1,5; worker $i$ gets entry $i \bmod 5$) or a list of `NUM_WORKERS` numbers. Heterogeneous speeds make the slow workers' arrivals very stale (the fast worker updates the model many times while they compute). |
# | `INNER_STEPS` ($H$) | inner AdamW steps per dispatch (async) or per round (sync). Larger $H$: fewer, larger pseudo-gradients; the staleness *distribution* depends on the speed ratios, not on $H$, but the simulated time per arrival grows with $H$. |
# | `NUM_WORKERS` ($K$) | more workers: more updates land while one computes, so $\tau$ grows with $K$ (about $K-1$ with equal speeds). The arrival weight is $\rho = 1/\sqrt{K}$. |
# | `PARTITION`, `DIRICHLET_ALPHA` | data skew: `non_iid` gives worker $i$ only language $i$ (the HeLoCo setting); `iid` gives every worker the mixed corpus; `dirichlet` draws each worker's language mixture from Dirichlet($\alpha$): small $\alpha$ = strong skew, large $\alpha$ = close to iid. Skewed data makes pseudo-gradients of different workers point in different directions. |
# | `METHODS` | the methods compared, run with identical data, budget and clock. |
# | `TOKENS`, `SEEDS`, model knobs | the token budget per run, the seeds, and the GPT's size. |
#
# **The outer rules** ([`docs/ALGORITHMS.md`](../docs/ALGORITHMS.md)). With $g = \rho\,\Delta$:
# `async_nesterov` applies Nesterov momentum to each arrival ($\eta = 0.07$, $\mu = 0.9$);
# `mla` (momentum look-ahead) uses $m \leftarrow \mu m + (1-\mu) g$, $\theta \leftarrow \theta - \eta(g + \mu m)$
# ($\eta = 0.7$); `heloco` is MLA plus a per-block directional correction of $g$ and look-ahead
# dispatch (workers start from $\theta - \eta\mu m$). For each block (parameter leaf) HeLoCo
# measures the cosine $c$ between the pseudo-gradient and the outer momentum $m$ (which summarises
# recent updates) and then **keeps** it ($c \ge c_{ok} = 0.2$), **rotates** it toward $m$ keeping
# its norm ($0 \le c < c_{ok}$), or **shrinks** the component that opposes $m$ ($c < 0$); with no
# reference yet ($m = 0$) it **passes** it unchanged. Stale, skewed pseudo-gradients tend to be the
# badly aligned ones, which is what the alignment figure shows.
#
# **What you get:** (1) staleness histograms per method and worker, (2) HeLoCo's alignment
# (cosine) and branch counts over simulated time, (3) validation loss against tokens and against
# simulated time, (4) final per-language losses and (5) a summary table.
#
# The test suite (`tests/test_notebook.py`) executes this notebook with `HELOCO_NOTEBOOK_FAST=1`,
# which shrinks every size so that it runs in seconds.

# %% tags=["parameters"]
import os

# ---- Parameters: change them here, then run all cells. ----------------------------------
METHODS = ["async_nesterov", "mla", "heloco", "diloco"]  # compared in this order; any of
                         # ddp, local_sgd, diloco, palsgd, async_nesterov, delayed_nesterov,
                         # mla, heloco. The first one is the baseline of the summary table.
SPEEDS = "severe"        # seconds per inner step: homogeneous | mild | moderate | severe | mixed,
                         # or a list of NUM_WORKERS positive numbers, e.g. [1, 2, 4, 8, 16]
NUM_WORKERS = 5          # K
INNER_STEPS = 5          # H: inner steps per dispatch (async) or per round (sync)
PARTITION = "non_iid"    # non_iid (worker i reads language i) | iid | dirichlet
DIRICHLET_ALPHA = 0.3    # data skew of PARTITION="dirichlet": small = skewed, large ~ iid
JITTER = 0.0             # relative per-step jitter of the simulated clock, in [0, 1)
TOKENS = 200_000         # token budget of each run (the applied inner steps of all workers)
SEEDS = [0]              # one run per method and seed, e.g. [0, 1, 2]

# Model and batch (the quickstart config uses d_model 128, 4 layers, context 128, batch 8).
D_MODEL = 64
NUM_LAYERS = 2
NUM_HEADS = 4
CONTEXT = 64
BATCH_SIZE = 8           # sequences per inner step per worker
EVALS_PER_RUN = 12       # validation points per run (every TOKENS / EVALS_PER_RUN tokens)

# The full version (500k tokens per run, 3 seeds; 147 s measured on 2 cores):
# HELOCO_NOTEBOOK_FULL=1, or FULL = True here. The committed outputs are the default's.
FULL = os.environ.get("HELOCO_NOTEBOOK_FULL", "0") == "1"
# The test's smoke setting (tiny model, a few thousand tokens): HELOCO_NOTEBOOK_FAST=1.
FAST = os.environ.get("HELOCO_NOTEBOOK_FAST", "0") == "1"

# %%
if FULL:
  TOKENS, SEEDS = 500_000, [0, 1, 2]
  print(f"FULL mode: {TOKENS} tokens per run, seeds {SEEDS}")
if FAST:  # same code paths, tiny sizes: the test suite runs this in seconds
  D_MODEL, NUM_LAYERS, NUM_HEADS, CONTEXT, BATCH_SIZE = 32, 1, 4, 16, 4
  INNER_STEPS, TOKENS, SEEDS, EVALS_PER_RUN = 2, 3_000, list(SEEDS)[:1], 4
  print(f"FAST mode: d_model {D_MODEL}, {NUM_LAYERS} layer, context {CONTEXT}, batch {BATCH_SIZE}, "
        f"H {INNER_STEPS}, {TOKENS} tokens, seeds {SEEDS}")

# %% [markdown]
# ## Set-up
#
# Every run is built by `hj.make_engine`, the library's one way to build an engine (the command
# line builds its runs there too). Its settings come from a run config: the quickstart config
# (`heloco_jax/cli/configs/default.py`) with this notebook's knobs, validated before anything runs,
# so a bad knob fails at once with a message naming it. `harness.default_problem` turns the
# config into the command line's problem (TinyGPT, the per-worker data, the held-out
# evaluation) and `harness.engine_options` into `hj.make_engine`'s keyword arguments (`method`,
# `inner_tx`, `inner_steps`, `speeds`, `budget` (an `hj.Budget` of tokens, with `tokens_per_step`
# and `eval_every_tokens`), `seed`, `jitter`, ...); your own model, loss and data go to
# `hj.make_engine` the same way (see the README). JAX's persistent
# compilation cache (in the temporary directory, unless `JAX_COMPILATION_CACHE_DIR` is set) lets
# runs of the same shapes reuse compiled programs, so re-running after changing speeds, skew or
# method is faster than the first time.

# %%
import math
import tempfile
import time

import jax
import matplotlib.pyplot as plt
import numpy as np

import heloco_jax as hj
from heloco_jax.cli.configs import default, validation
from heloco_jax.lm import data, harness
from heloco_jax.runtime import clocks
from heloco_jax.training.methods import METHODS as REGISTRY

# %matplotlib inline

if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  jax.config.update("jax_compilation_cache_dir",
                    os.path.join(tempfile.gettempdir(), "heloco_jax_notebook_xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def make_config(method: str, seed: int):
  """The quickstart config with this notebook's knobs (validated)."""
  c = default.get_config()
  c.method, c.seed = method, seed
  c.num_workers, c.inner_steps = NUM_WORKERS, INNER_STEPS
  c.speeds, c.jitter = SPEEDS, JITTER
  c.batch_size = BATCH_SIZE
  c.budget.tokens = TOKENS
  c.budget.eval_every_tokens = max(1, TOKENS // EVALS_PER_RUN)
  c.checkpoint.every = 0
  c.model.d_model, c.model.num_layers = D_MODEL, NUM_LAYERS
  c.model.num_heads, c.model.context = NUM_HEADS, CONTEXT
  c.data.partition, c.data.dirichlet_alpha = PARTITION, DIRICHLET_ALPHA
  c.data.val_sequences_per_language = 8 if FAST else 16
  c.data.max_bytes_per_language = 40_000 if FAST else 0
  # The inner learning-rate schedule spans the budget (at most TOKENS / tokens-per-step steps).
  steps = max(100, math.ceil(TOKENS / (BATCH_SIZE * CONTEXT)))
  c.inner.total_steps, c.inner.warmup_steps = steps, max(2, steps // 20)
  validation.validate(c)
  return c


def make_dataset(c):
  """The data of `c` (`harness.default_problem` would build it); shared by the runs of one
  seed."""
  return data.make_data(
      source=c.data.source, partition=c.data.partition, dirichlet_alpha=c.data.dirichlet_alpha,
      num_workers=c.num_workers, context=c.model.context, batch_size=c.batch_size,
      val_sequences_per_language=c.data.val_sequences_per_language, seed=c.seed,
      max_bytes_per_language=c.data.max_bytes_per_language or None)


unknown = [m for m in METHODS if m not in REGISTRY]
assert not unknown, f"unknown methods {unknown}; allowed: {', '.join(REGISTRY)}"
configs = {(m, s): make_config(m, s) for m in METHODS for s in SEEDS}
SECONDS = clocks.seconds_per_step(SPEEDS, NUM_WORKERS)  # seconds per inner step, per worker
ASYNC = [m for m in METHODS if REGISTRY[m].synchrony == "async"]
COLORS = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(METHODS)}
print(f"{len(configs)} runs: methods {METHODS}, seeds {SEEDS}; K = {NUM_WORKERS}, "
      f"H = {INNER_STEPS}, seconds per step {SECONDS.tolist()}, partition {PARTITION}"
      + (f" (alpha = {DIRICHLET_ALPHA})" if PARTITION == "dirichlet" else ""))


# %% [markdown]
# ## Run the simulations
#
# One line per run: a dot per validation point while it runs, then the validation loss before
# and after, the outer updates, the simulated seconds and the wall time. The first run compiles
# the model and is the slowest. A run is `engine = hj.make_engine(loss_fn, params, data, ...)`,
# then `summary = await engine.run(on_row)`; `engine.rows` holds its metrics rows (the kinds
# and keys of rows: `docs/DESIGN.md`, "metrics.jsonl") and `engine.params` the final
# parameters. (`hj.simulate` does the same in one call, but it calls `asyncio.run`, which cannot
# run inside Jupyter's own event loop, so the cell awaits `engine.run` directly.)

# %%
def show_progress(row):
  if row["event"] == "eval":
    print(".", end="", flush=True)


results = []  # one dict per run: method, seed, summary, rows (eval and arrival rows), wall
datasets = {}
start_all = time.perf_counter()
for method in METHODS:
  for seed in SEEDS:
    config = configs[(method, seed)]
    if seed not in datasets:
      datasets[seed] = make_dataset(config)
    print(f"{method:<16} seed {seed} ", end="", flush=True)
    start = time.perf_counter()
    problem = harness.default_problem(config, datasets[seed])  # TinyGPT, data, evaluation
    engine = hj.make_engine(
        problem.loss_fn, problem.params,
        [problem.data.worker_iterator(i) for i in range(NUM_WORKERS)],  # one stream per worker
        eval_fn=problem.eval_fn, **harness.engine_options(config))
    try:
      summary = await engine.run(on_row=show_progress)
    finally:
      engine.close()
    wall = time.perf_counter() - start
    results.append({"method": method, "seed": seed, "summary": summary,
                    "rows": engine.rows, "wall": wall})
    print(f" val_loss {summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f}, "
          f"{summary['outer_updates']} outer updates, {summary['sim_time']:.0f} simulated s, "
          f"{wall:.1f} s wall")
print(f"all runs: {time.perf_counter() - start_all:.1f} s wall")


def runs_of(method):
  return [r for r in results if r["method"] == method]


def rows_of(run, event):
  return [row for row in run["rows"] if row["event"] == event]


# %% [markdown]
# ## 1. Staleness histograms
#
# For each asynchronous method: how stale the applied pseudo-gradients were, stacked by worker
# (all seeds pooled). Arrival times depend only on the simulated clock (speeds, $H$, jitter and
# seed), not on the outer rule, so every async method sees the same staleness; what differs is
# how each rule copes with it. With `severe` speeds the fast worker's
# arrivals are nearly fresh, while the fast worker applies about 15 updates (the ratio of the
# step times) during one dispatch of a slow worker, so the slow workers' arrivals are 15 or more
# updates old.

# %%
if not ASYNC:
  print("No asynchronous method in METHODS: synchronous rounds have staleness 0.")
else:
  fig, axes = plt.subplots(1, len(ASYNC), figsize=(4.6 * len(ASYNC), 3.6), sharey=True,
                           squeeze=False)
  for ax, method in zip(axes[0], ASYNC):
    arrivals = [row for run in runs_of(method) for row in rows_of(run, "arrival")]
    taus = np.array([row["staleness"] for row in arrivals], dtype=int)
    workers = np.array([row["worker"] for row in arrivals], dtype=int)
    bins = np.arange((taus.max() if taus.size else 0) + 2) - 0.5
    ax.hist([taus[workers == w] for w in range(NUM_WORKERS)], bins=bins, stacked=True,
            label=[f"worker {w} ({SECONDS[w]:g} s/step)" for w in range(NUM_WORKERS)])
    ax.set_title(f"{method}: {taus.size} arrivals, mean tau {taus.mean() if taus.size else 0:.1f}")
    ax.set_xlabel("staleness tau (outer updates)")
  axes[0][0].set_ylabel("arrivals")
  axes[0][-1].legend(fontsize=8)
  fig.tight_layout()
  plt.show()

  # Per worker: arrivals and mean / max staleness (first async method, all seeds).
  arrivals = [row for run in runs_of(ASYNC[0]) for row in rows_of(run, "arrival")]
  print(f"staleness per worker ({ASYNC[0]}, all seeds)")
  print("| worker | s/step | arrivals | mean tau | max tau |")
  print("| --- | --- | --- | --- | --- |")
  for w in range(NUM_WORKERS):
    taus = [row["staleness"] for row in arrivals if row["worker"] == w]
    print(f"| {w} | {SECONDS[w]:g} | {len(taus)} | "
          + (f"{np.mean(taus):.1f} | {max(taus)} |" if taus else "- | - |"))

# %% [markdown]
# ## 2. Alignment over time (HeLoCo)
#
# Left: the cosine between each arrival's pseudo-gradient and the outer momentum (mean over
# blocks), over simulated time, coloured by the arrival's staleness; the dashed line is the keep
# threshold $c_{ok}$. Middle: the same cosine against staleness (all seeds). Right: which branch
# the blocks of each arrival took (pass: no momentum yet; keep; rotate toward $m$; shrink the
# opposing component), as fractions of the blocks, over simulated time.

# %%
heloco_runs = runs_of("heloco")
if not heloco_runs:
  print('Add "heloco" to METHODS to see its alignment diagnostics.')
else:
  branches = ["pass", "keep", "rotate", "shrink"]
  first = rows_of(heloco_runs[0], "arrival")
  t = np.array([row["sim_time"] for row in first])
  cosine = np.array([row["cosine_mean"] for row in first])
  tau = np.array([row["staleness"] for row in first])
  counts = np.array([[row[f"branch_count/{b}"] for b in branches] for row in first], float)
  fractions = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
  keep_threshold = configs[("heloco", heloco_runs[0]["seed"])].outer.keep_threshold

  fig, axes = plt.subplots(1, 3, figsize=(16, 4))
  points = axes[0].scatter(t, cosine, c=tau, cmap="viridis", s=16)
  fig.colorbar(points, ax=axes[0], label="staleness tau")
  axes[0].axhline(keep_threshold, ls="--", color="tab:green", label=f"keep threshold {keep_threshold}")
  axes[0].axhline(0.0, color="grey", lw=0.8)
  axes[0].set(xlabel="simulated time (s)", ylabel="cosine(pseudo-gradient, momentum)",
              title=f"heloco, seed {heloco_runs[0]['seed']}")
  axes[0].legend(fontsize=8)

  all_rows = [row for run in heloco_runs for row in rows_of(run, "arrival")]
  all_tau = np.array([row["staleness"] for row in all_rows])
  all_cos = np.array([row["cosine_mean"] for row in all_rows])
  axes[1].scatter(all_tau, all_cos, s=12, alpha=0.6, color=COLORS["heloco"])
  levels = np.unique(all_tau)
  axes[1].plot(levels, [all_cos[all_tau == level].mean() for level in levels], "k.-", label="mean")
  axes[1].axhline(keep_threshold, ls="--", color="tab:green")
  axes[1].set(xlabel="staleness tau", ylabel="cosine", title="alignment vs staleness")
  axes[1].legend(fontsize=8)

  axes[2].stackplot(t, fractions.T, labels=branches, step="post", alpha=0.85)
  axes[2].set(xlabel="simulated time (s)", ylabel="fraction of blocks", ylim=(0, 1),
              title="HeLoCo branch per arrival")
  axes[2].legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  plt.show()

  totals = counts.sum(axis=0)
  print("blocks per branch over the run (seed %d): " % heloco_runs[0]["seed"]
        + ", ".join(f"{b} {int(n)} ({n / max(totals.sum(), 1):.0%})" for b, n in zip(branches, totals)))

# %% [markdown]
# ## 3. Validation loss
#
# Against tokens (equal work) and against simulated time (equal wall clock). Synchronous methods
# wait for the slowest worker every round, so for the same tokens they need much more simulated
# time when speeds are heterogeneous; asynchronous methods keep every worker busy but apply stale
# pseudo-gradients. With `non_iid` data and `severe` speeds most of an async run's tokens come
# from the fast worker's one language, so its curve follows that language and moves when the
# slow workers' (other languages') pseudo-gradients land; the per-language plot below shows it.
# Lines of one colour: seeds.

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
for method in METHODS:
  for i, run in enumerate(runs_of(method)):
    evals = rows_of(run, "eval")
    loss = [row["val_loss"] for row in evals]
    label = method if i == 0 else None
    axes[0].plot([row["tokens"] for row in evals], loss, ".-", color=COLORS[method], label=label)
    axes[1].plot([row["sim_time"] for row in evals], loss, ".-", color=COLORS[method], label=label)
axes[0].set(xlabel="tokens", ylabel="validation loss", title="loss vs tokens")
axes[1].set(xlabel="simulated time (s)", title="loss vs simulated time")
axes[0].legend()
fig.tight_layout()
plt.show()

# %%
# Final validation loss per language (mean over seeds): data skew shows up here.
final = {m: [rows_of(run, "eval")[-1] for run in runs_of(m)] for m in METHODS}
languages = sorted(k.split("/", 1)[1] for k in final[METHODS[0]][0] if k.startswith("val_loss/"))
width = 0.8 / len(METHODS)
fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(languages) + 2), 3.6))
for i, method in enumerate(METHODS):
  values = [np.mean([row[f"val_loss/{lang}"] for row in final[method]]) for lang in languages]
  ax.bar(np.arange(len(languages)) + (i - (len(METHODS) - 1) / 2) * width, values, width,
         label=method, color=COLORS[method])
lowest = min(np.mean([row[f"val_loss/{lang}"] for row in final[m]]) for m in METHODS
             for lang in languages)
ax.set_xticks(np.arange(len(languages)), languages)
ax.set(ylabel="final validation loss", title=f"per language ({PARTITION} partition)",
       ylim=(0.9 * lowest, None))
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
fig.tight_layout()
plt.show()


# %% [markdown]
# ## 4. Summary
#
# Final validation loss at the token budget (mean ± std over seeds), its relative improvement
# over the first method, $(L_{base} - L)/L_{base}$, as in the HeLoCo paper, and the loss at a
# fixed simulated time $T$: the earliest time at which some method ended, read from each run's
# last validation point at or before $T$.

# %%
def loss_at(run, t):
  evals = [row for row in rows_of(run, "eval") if row["sim_time"] <= t]
  return evals[-1]["val_loss"]


def mean_std(values, fmt="{:.3f}"):
  text = fmt.format(np.mean(values))
  return text + (" ± " + fmt.format(np.std(values)) if len(values) > 1 else "")


T = min(run["summary"]["sim_time"] for run in results)
baseline = np.mean([run["summary"]["final_val_loss"] for run in runs_of(METHODS[0])])
header = ["method", "synchrony", "runs", "final val loss", f"vs {METHODS[0]}",
          f"loss @ {T:.0f} sim s", "outer updates", "sim s", "mean tau", "max tau", "wall s"]
lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
for method in METHODS:
  runs = runs_of(method)
  finals = [run["summary"]["final_val_loss"] for run in runs]
  taus = [row["staleness"] for run in runs for row in rows_of(run, "arrival")]
  lines.append("| " + " | ".join([
      method, REGISTRY[method].synchrony, str(len(runs)), mean_std(finals),
      f"{(baseline - np.mean(finals)) / baseline:+.1%}",
      mean_std([loss_at(run, T) for run in runs]),
      mean_std([run["summary"]["outer_updates"] for run in runs], "{:.0f}"),
      mean_std([run["summary"]["sim_time"] for run in runs], "{:.0f}"),
      f"{np.mean(taus):.1f}" if taus else "0", str(max(taus)) if taus else "0",
      f"{sum(run['wall'] for run in runs):.1f}"]) + " |")
print(f"{TOKENS} tokens per run, K = {NUM_WORKERS}, H = {INNER_STEPS}, speeds {SPEEDS}, "
      f"partition {PARTITION}")
print("\n".join(lines))

# %% [markdown]
# ## Things to try
#
# - `SPEEDS = "homogeneous"`: staleness collapses to about $K - 1$ for every worker and the sync
#   methods stop losing simulated time; `"mixed"` spreads it out.
# - `NUM_WORKERS = 10` or `16`: staleness grows with $K$ (presets repeat every 5 workers).
# - `INNER_STEPS = 20`: fewer, larger pseudo-gradients and fewer outer updates per token.
# - `PARTITION = "iid"` vs `"non_iid"`, or `"dirichlet"` with `DIRICHLET_ALPHA` 0.1 … 10: how data
#   skew changes HeLoCo's cosines and branch counts.
# - Add `"delayed_nesterov"`, `"local_sgd"`, `"palsgd"` or `"ddp"` to `METHODS`; `SEEDS = [0, 1, 2]`
#   for error bars (each run is ~10–20 s with the defaults).
# - For the full-size runs and the reproduction grid use the command line:
#   `heloco-jax train --workdir=DIR --config.method=... --config.speeds=...`.
