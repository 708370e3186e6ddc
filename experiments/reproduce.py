"""Runs a grid of ``experiments/grids.py`` and writes its RESULTS.md and figures.

  python -m experiments.reproduce --grid=paper --out=DIR [--corpus=PATH] [--only=REGEX]
  python -m experiments.reproduce --grid=all --out=DIR        # + tuning, PALSGD, ablations
  python -m experiments.reproduce --grid=smoke --out=DIR      # a few minutes, synthetic data
  python -m experiments.reproduce --grid=science --out=DIR    # issue 18's grids: hours
  python -m experiments.reproduce --grid=science --out=DIR --report-only  # RESULTS.md only
  python -m experiments.reproduce --grid=body,merge_order --out=DIR --deadline=SECONDS
      # grids of one report in order: the later ones' runs fill what the earlier ones' cannot

Each run is ``heloco-jax train`` in ``OUT/runs/<name>``: ``--jobs`` at a time
as processes pinned to their own cores (default: one per core), or with
``--jobs=1`` in this process (compiled programs are cached in
``OUT/xla_cache``). A finished run's digest goes to experiments/results (the
smoke grid: OUT/results); runs with a digest are skipped and interrupted ones
resume from their checkpoints, before any new run starts, so the same command
continues a grid after any interruption (experiments/README.md, "The runner").
The paper grid reads the debian_docs corpus (de, en, es, fr, it); it is built
into ``OUT/corpus`` when ``--corpus`` is not given (``heloco-jax corpus``,
about a minute, Debian packages only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

import numpy as np

from experiments import aggregation, analysis, chaos, grids, science, streaming
from heloco_jax.runtime import clocks
from heloco_jax.training import methods

_HERE = os.path.dirname(os.path.abspath(__file__))


def corpus_vocabularies(runs: Sequence[grids.Run]) -> dict[str, int]:
  """The BPE vocabularies ``runs`` read from the corpus folder (``grids.CORPUS`` in their
  ``data.tokenizer``): file name -> ids (``grids.CORPUS_VOCABS``)."""
  vocabs = {}
  for run in runs:
    tokenizer = str(dict(run.overrides).get("data.tokenizer", ""))
    if tokenizer.startswith(grids.CORPUS + "/"):
      name = tokenizer[len(grids.CORPUS) + 1:]
      vocabs[name] = grids.CORPUS_VOCABS[name]
  return vocabs


def extra_corpora(runs: Sequence[grids.Run]) -> list[str]:
  """The suffixes of the corpus folders next to the grid's that ``runs`` read (their own
  ``data.path`` ``grids.CORPUS + suffix``; ``grids.EXTRA_CORPORA``)."""
  found = {str(dict(run.overrides).get("data.path", "")) for run in runs}
  return sorted(p[len(grids.CORPUS):] for p in found if p.startswith(grids.CORPUS))


def _corpus(path: Optional[str], out: str, runs: Sequence[grids.Run]) -> str:
  """An existing corpus folder, or one built into OUT/corpus; with the BPE vocabularies the
  runs read (``corpus_vocabularies``), each trained there when missing or of another size,
  and the folders next to it that they read (``extra_corpora``), built when missing."""
  vocabs = corpus_vocabularies(runs)
  from heloco_jax.cli import main as cli  # pylint: disable=g-import-not-at-top
  if path:
    if not os.path.isdir(path):
      raise SystemExit(f"reproduce: --corpus={path!r} is not a directory")
  else:
    path = os.path.join(out, "corpus")
    if not os.path.exists(os.path.join(path, "manifest.json")):
      print(f"reproduce: building the debian_docs corpus into {path}", file=sys.stderr)
      if cli.main(["corpus", "debian_docs", f"--languages={grids.LANGUAGES}", f"--out={path}",
                   f"--vocab-size={vocabs.get('tokenizer.json', 0)}"]) != 0:
        raise SystemExit("reproduce: the corpus could not be built; pass --corpus=DIR (a "
                         "folder of text per language) instead")
  for name, vocab in vocabs.items():
    tokenizer = os.path.join(path, name)
    size = 0
    if os.path.exists(tokenizer):
      with open(tokenizer) as f:
        size = len(json.load(f)["model"]["vocab"])
    if size == vocab:
      continue
    print(f"reproduce: training the {vocab}-id BPE vocabulary {tokenizer} (it has "
          f"{size or 'none'})", file=sys.stderr)
    if name == "tokenizer.json":  # the corpus command's own file
      if cli.main(["corpus", "bpe", f"--out={path}", f"--vocab-size={vocab}"]) != 0:
        raise SystemExit(f"reproduce: the BPE vocabulary of {path} could not be trained")
      continue
    # The same training as `heloco-jax corpus bpe` (every language of the folder, without the
    # last 10% of each), written under another name so that both sizes sit in one corpus.
    from heloco_jax.lm.data import bpe, sources  # pylint: disable=g-import-not-at-top
    bpe.train(sources.load_documents("text_dir", path, None, None), vocab).save(tokenizer)
  for suffix in extra_corpora(runs):
    languages, vocab = grids.EXTRA_CORPORA[suffix]
    if not os.path.exists(os.path.join(path + suffix, "tokenizer.json")):
      print(f"reproduce: building the debian_docs corpus of {languages} into {path + suffix}",
            file=sys.stderr)
      if cli.main(["corpus", "debian_docs", f"--languages={languages}", f"--out={path + suffix}",
                   f"--vocab-size={vocab}"]) != 0:
        raise SystemExit(f"reproduce: the corpus {path + suffix} could not be built")
  return path


def _scale_note(name: str) -> str:
  scale = grids.SCALES[name]
  if name in grids.SCIENCE + grids.SKEPTIC:
    return (
        f"The HeLoCo authors' harness (`heloco_stable_v2.py`): 5 workers, one language each "
        f"(de, en, es, fr, it; Debian's translated LibreOffice help), GPT d_model 128, 8 "
        f"layers, 4 heads, context 128, batch 2 × 128 tokens, H = 20, 10,000 local steps "
        f"(2.56M tokens) per run, inner AdamW lr 2e-4 with cosine decay to 1e-6 over each "
        f"worker's 2,000 steps, weight decay 1e-2, no clipping, a fresh AdamW state per "
        f"dispatch; outer lrs 0.07 (async Nesterov, DN), 0.7 (MLA, HeLoCo, sync), μ 0.9, "
        f"ρ = 1/√5; seeds {list(scale.seeds)}, and {list(grids.SYMMETRIC_SEEDS)} for every run "
        f"of the authors'-setting, jitter and best-lr claims rows (`--grid=symmetric`, the claims "
        f"table's seeds column says how many have landed). **One change:** a {grids.AUTHORS_VOCAB}-id "
        f"byte-level BPE trained on the corpus instead of GPT-2's 50,257 ids (2.1M instead of "
        f"14.5M parameters; the depth and width are the authors'), so that the grid fits a "
        f"2-core CPU; losses are therefore not comparable with the authors' in absolute terms.")
  note = (f"Grid `{name}`: 5 workers, one language each, GPT d_model {scale.d_model}, "
          f"{scale.num_layers} layers, context {scale.context}, batch {scale.batch_size}, "
          f"H = {scale.inner_steps}, {scale.tokens:,} tokens per run (token table), seeds "
          f"{list(scale.seeds)}; outer learning rates and momenta from ALGORITHMS.md.")
  if scale is not grids.PAPER:
    return note
  return note + (
      "\n\n**Shrunk to fit a 2-core CPU** (the paper grid, 120 runs, takes about 2 hours "
      "here; tuning, PALSGD and the one-seed ablations about 40 minutes more): a 0.28M-parameter GPT with a "
      "byte vocabulary instead of the paper's models of 10⁸ parameters and more, 1M tokens "
      "per run instead of billions, context 64, 4 sequences per inner step, and Debian's "
      "translated documentation (a few MB of help text per language) instead of a web-scale "
      "multilingual corpus. At this size a run is ~3,900 inner steps, so synchronous DiLoCo "
      "makes only ~39 outer updates per run and every method sees the corpus in well under "
      "one epoch per language. The heterogeneity presets, H, K, the outer rules and their "
      "defaults are the paper's.")


def _cores() -> list[int]:
  return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
      range(os.cpu_count() or 1))


def expected_tokens(run: grids.Run) -> float:
  """The tokens a run will read: its token budget, or for a time budget what synchronous
  workers read in it (K·batch·context per slowest step)."""
  o = dict(run.overrides)
  if o.get("budget.tokens"):
    return float(o["budget.tokens"])
  k = int(o.get("num_workers", 5))
  slowest = float(np.max(clocks.seconds_per_step(o.get("speeds", "severe"), k)))
  return o["budget.sim_seconds"] * k * o["batch_size"] * o["model.context"] / slowest


def checkpointed_share(run: grids.Run, workdir: str) -> float:
  """The share of ``run``'s budget that its newest checkpoint in ``workdir`` holds, where its
  resume starts (0 without one): tokens of a token budget, simulated seconds of a time
  budget, the larger where both are set. Reads the checkpoint's meta only."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return 0.0  # most runs: no checkpoint manager (nor orbax) needed
  from heloco_jax.rundir import checkpoint  # pylint: disable=g-import-not-at-top
  meta = checkpoint.newest_meta(directory)
  if meta is None:
    return 0.0
  o = dict(run.overrides)
  shares = [meta.get("units", 0) / o["budget.tokens"] if o.get("budget.tokens") else 0.0,
            meta.get("sim_time", 0.0) / o["budget.sim_seconds"]
            if o.get("budget.sim_seconds") else 0.0]
  return min(1.0, max(shares))


def resumes_first(todo: Sequence[grids.Run], out: str
                  ) -> tuple[list[grids.Run], dict[str, float]]:
  """``todo`` with the runs that resume from a checkpoint first (the grid's order otherwise),
  and their checkpoints' shares of their budgets (``checkpointed_share``): a run stopped part
  way (a session's end, SIGTERM) finishes before a new one starts, and counts its time left."""
  started = {run.name: share for run in todo
             if (share := checkpointed_share(run, os.path.join(out, "runs", run.name))) > 0}
  return sorted(todo, key=lambda run: run.name not in started), started


def _shape(run: grids.Run) -> tuple:
  """The model's shape and the method's inner loop: a palsgd8m PALSGD run costs 1.2–1.5× DDP's
  seconds per token on the same model (experiments/README.md)."""
  o = dict(run.overrides)
  method = methods.METHODS.get(o.get("method", run.method))
  return (*(o.get(k) for k in ("model.d_model", "model.num_layers", "model.context",
                               "data.tokenizer", "batch_size")), method and method.inner)


class Progress:
  """The grid's position and time left: seconds per token of each model shape, times the
  tokens left, over the runs running at once.

  The rates come from each finished run's summary ``wall_seconds`` (its training time, all
  its resumed parts together): those of the runs this command finishes (this machine's) where
  it has finished one of that shape, else those of ``timed``, the (run, wall_seconds) of runs
  finished before it (perhaps on another machine: one 2-core machine of this project trains
  the body grid's model 1.5–2× slower than another).
  """

  def __init__(self, todo: Sequence[grids.Run], jobs: int,
               timed: Sequence[tuple[grids.Run, float]] = (),
               started: Optional[Mapping[str, float]] = None):
    self.left = {r.name: r for r in todo}
    self.started = dict(started or {})  # run name -> its checkpoint's share of the budget
    self.jobs, self.total, self.done = jobs, len(todo), 0
    self._earlier: dict[tuple, list[float]] = {}  # seconds per token by shape
    self._here: dict[tuple, list[float]] = {}
    for run, wall_seconds in timed:
      self._rate(self._earlier, run, wall_seconds)

  @staticmethod
  def _rate(rates: dict[tuple, list[float]], run: grids.Run, wall_seconds: float) -> None:
    if wall_seconds > 0:  # 0: a summary from before wall_seconds was kept
      rates.setdefault(_shape(run), []).append(wall_seconds / expected_tokens(run))

  def finished(self, run: grids.Run, wall_seconds: float) -> None:
    self.done += 1
    self.left.pop(run.name, None)
    self._rate(self._here, run, wall_seconds)

  def training_seconds(self, run: grids.Run) -> Optional[float]:
    """``run``'s expected training time: its shape's mean seconds per token × its tokens
    left (all but its checkpoint's share, ``started``; None: no run of its model timed yet).
    Until a run of its inner loop is timed, the model's runs of other loops give the rate."""
    shape = _shape(run)
    model = [[rate for key, some in rates.items() if key[:-1] == shape[:-1] for rate in some]
             for rates in (self._here, self._earlier)]
    rates = self._here.get(shape) or self._earlier.get(shape) or model[0] or model[1]
    left = 1.0 - self.started.get(run.name, 0.0)
    return float(np.mean(rates)) * expected_tokens(run) * left if rates else None

  def eta(self) -> str:
    seconds, unknown = 0.0, 0
    for run in self.left.values():
      expected = self.training_seconds(run)
      if expected is not None:
        seconds += expected
      else:
        unknown += 1
    if not self.left:
      return "all done"
    seconds /= self.jobs
    text = ("time left unknown" if not seconds else f"about {seconds / 3600:.1f} h left"
            if seconds >= 3600 else f"about {seconds / 60:.0f} min left")
    if seconds and unknown:
      text += f" (+ {unknown} runs of a size not timed yet)"
    return text


def _last_progress(log: str) -> str:
  """The newest ``heloco-jax train: N tokens ...`` line of a run's log, shortened."""
  try:
    with open(log, errors="replace") as f:
      lines = [line for line in f.read().splitlines() if " tokens" in line]
  except OSError:
    return ""
  return lines[-1].replace("heloco-jax train: ", "") if lines else ""


# ``python -m heloco_jax.cli.train`` on the given cores (Linux; elsewhere unpinned).
_PINNED = ("import os, runpy, sys\n"
           "if hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {cores})\n"
           "runpy.run_module('heloco_jax.cli.train', run_name='__main__', alter_sys=True)")


def commit_digests(results_dir: str, message: str) -> None:
  """Commits what is new or changed in ``results_dir`` (that folder only: whatever else is
  staged stays staged), so that a grid spanning sessions keeps every finished run. When git
  fails (no repository, no identity, a lock) it says so in one line; the digests stay on disk
  and go into the next commit."""
  git = ["git", "-C", results_dir]
  try:
    subprocess.run([*git, "add", "--", "."], check=True, capture_output=True, text=True)
    changed = subprocess.run([*git, "status", "--porcelain", "--", "."], check=True,
                             capture_output=True, text=True).stdout.strip()
    if changed:
      subprocess.run([*git, "commit", "-q", "-m", message, "--", "."], check=True,
                     capture_output=True, text=True)
  except (OSError, subprocess.CalledProcessError) as e:
    detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()
    print(f"reproduce: --commit: git failed ({detail[-1] if detail else e}); the digests stay "
          f"in {results_dir}", file=sys.stderr, flush=True)


def prune_checkpoints(workdir: str) -> None:
  """Deletes a finished run's checkpoints but its newest (its final state): a 50,257-id run
  keeps three of 776 MB each otherwise."""
  from heloco_jax.rundir import checkpoint  # pylint: disable=g-import-not-at-top
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory) or len(os.listdir(directory)) <= 1:
    return  # nothing to prune (most runs at start-up, once pruned): no checkpoint manager
  checkpointer = checkpoint.Checkpointer(directory, keep=1)
  try:
    steps = checkpointer.steps()
    if steps:
      checkpointer.drop_before(steps[-1])
  finally:
    checkpointer.close()


def finish(run: grids.Run, out: str, results_dir: str, commit: bool, prune: bool) -> None:
  """A finished run's digest into ``results_dir`` (and git, with ``commit``); with ``prune``,
  its checkpoints but the newest deleted."""
  workdir = os.path.join(out, "runs", run.name)
  analysis.write_digest(workdir, results_dir, run)
  if commit:
    commit_digests(results_dir, f"experiments/results: {run.name}")
  if prune:
    prune_checkpoints(workdir)


# A run's start besides its training time (the interpreter, JAX, the data, a compile from the
# cache, the first evaluation): 20-40 s seen on a 2-core machine; counted against --deadline.
START_SECONDS = 60.0


def next_fitting(queue: Sequence[grids.Run], progress: Progress, deadline: float
                 ) -> Optional[int]:
  """The index in ``queue`` of the first run expected to end by ``deadline``
  (``time.monotonic()``): its training time (``Progress.training_seconds``) and its start
  (``START_SECONDS``); a run of a shape not timed yet while the deadline has not passed. None
  when no run fits: a run the deadline cuts off is lost with the machine."""
  now = time.monotonic()
  if now > deadline:
    return None
  for i, run in enumerate(queue):
    seconds = progress.training_seconds(run)
    if seconds is None or now + START_SECONDS + seconds <= deadline:
      return i
  return None


def _left_for_later(queue: Sequence[grids.Run], deadline: float) -> None:
  left = deadline - time.monotonic()
  why = ("--deadline passed" if left < 0 else
         f"--deadline in {left / 60:.0f} min, which no queued run is expected to end by")
  print(f"reproduce: {why}: {len(queue)} runs not started ({queue[0].name} next); "
        "the same command starts them", file=sys.stderr, flush=True)


def _start_first(queue: Sequence[grids.Run], index: int, progress: Progress) -> None:
  if index:
    expected = progress.training_seconds(queue[0]) or 0.0
    print(f"reproduce: {queue[0].name} would end after --deadline (about "
          f"{(expected + START_SECONDS) / 60:.0f} min): {queue[index].name} starts first",
          file=sys.stderr, flush=True)


def run_parallel(todo: Sequence[grids.Run], out: str, data_path: str, results_dir: str,
                 jobs: int, heartbeat: float = 300.0, commit: bool = False,
                 timed: Sequence[tuple[grids.Run, float]] = (), prune: bool = False,
                 deadline: float = float("inf"),
                 started: Optional[Mapping[str, float]] = None) -> int:
  """Runs ``todo`` as ``python -m heloco_jax.cli.train`` processes, ``jobs`` at a time, each pinned
  to its own cores with as many XLA threads (two 1-thread runs train 1.41× the tokens/s of one
  2-thread run on 2 cores). Logs go to OUT/logs/<name>.log; each finished run's digest to
  ``results_dir`` (and, with ``commit``, into git; ``prune``: see ``finish``). ``timed``:
  finished runs' (run, wall_seconds), for the time left (``Progress``) before a run of this
  call ends; ``started``: the shares of their budgets that runs resuming from a checkpoint
  hold (``resumes_first``). A run starts only if it is expected to end by ``deadline``
  (``time.monotonic()``; ``--deadline``; ``next_fitting``): the first queued one that does.
  SIGTERM or Ctrl-C stops the running runs at their next checkpoint boundary (they resume when the
  command is run again). Returns 0, 1 (some run failed) or 130."""
  cores = _cores()
  jobs = max(1, min(jobs, len(cores), len(todo)))
  per_job = len(cores) // jobs
  slots = [cores[i * per_job:(i + 1) * per_job] for i in range(jobs)]
  progress, queue, running, failed = Progress(todo, jobs, timed, started), list(todo), {}, []
  stopping = []

  def stop(signum, frame):
    del frame
    stopping.append(signum)
    for proc, *_ in running.values():
      proc.send_signal(signal.SIGTERM)
  previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
  print(f"reproduce: {len(todo)} runs, {jobs} at a time, {per_job} core(s) each; logs in "
        f"{os.path.join(out, 'logs')}", file=sys.stderr, flush=True)
  last_beat = time.monotonic()
  try:
    while running or (queue and not stopping):  # a stop leaves the queue for next time
      while queue and len(running) < jobs and not stopping:
        index = next_fitting(queue, progress, deadline)
        if index is None:
          _left_for_later(queue, deadline)
          queue = []
          break
        _start_first(queue, index, progress)
        run = queue.pop(index)
        index = next(i for i in range(jobs) if i not in running)
        slot = slots[index]
        log = os.path.join(out, "logs", run.name + ".log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                          " --xla_cpu_multi_thread_eigen=false "
                                          f"intra_op_parallelism_threads={len(slot)}").strip())
        command = [sys.executable, "-c", _PINNED.format(cores=tuple(slot)),
                   f"--workdir={os.path.join(out, 'runs', run.name)}", *run.args(data_path),
                   f"--compilation_cache={os.path.join(out, 'xla_cache')}"]
        with open(log, "a") as f:  # no preexec_fn: forking this (JAX) process is unsafe
          proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env)
        running[index] = (proc, run, log, time.monotonic())
        print(f"reproduce: [{progress.done + len(running)}/{progress.total}] started {run.name} "
              f"(cores {','.join(map(str, slot))})", file=sys.stderr, flush=True)
      time.sleep(1.0)
      for index, (proc, run, log, started) in list(running.items()):
        if proc.poll() is None:
          continue
        del running[index]
        minutes = (time.monotonic() - started) / 60
        if proc.returncode == 0:
          finish(run, out, results_dir, commit, prune)
          with open(os.path.join(out, "runs", run.name, "summary.json")) as f:
            summary = json.load(f)
          progress.finished(run, summary["wall_seconds"])
          print(f"reproduce: [{progress.done}/{progress.total} done] {run.name}: val_loss "
                f"{summary['final_val_loss']:.4f} in {minutes:.1f} min; {progress.eta()}",
                file=sys.stderr, flush=True)
        elif stopping:
          print(f"reproduce: {run.name} stopped (exit {proc.returncode}); it resumes from its "
                "checkpoint when the command runs again", file=sys.stderr, flush=True)
        else:
          failed.append(run.name)
          with open(log, errors="replace") as f:
            tail = f.read().splitlines()[-3:]
          print(f"reproduce: {run.name} failed (exit {proc.returncode}; {log}):\n  " +
                "\n  ".join(tail), file=sys.stderr, flush=True)
      if running and time.monotonic() - last_beat >= heartbeat:
        last_beat = time.monotonic()
        states = "; ".join(f"{run.name}: {_last_progress(log) or 'starting'}"
                           for _, run, log, _ in running.values())
        print(f"reproduce: [{progress.done}/{progress.total} done] running {states}; "
              f"{progress.eta()}", file=sys.stderr, flush=True)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  if stopping:
    return 130
  if failed:
    print(f"reproduce: {len(failed)} runs failed: {', '.join(failed)}; re-run the command to "
          "retry them (finished runs are skipped)", file=sys.stderr)
    return 1
  return 0


def _report(name: str) -> str:
  """The report a grid's runs go to (``main``): the smoke grid's own, RESULTS.md
  (``grids.ONE_REPORT``) or RESULTS_small_scale.md."""
  if grids.SCALES[name] is grids.SMOKE:
    return "smoke"
  return "RESULTS.md" if name in grids.ONE_REPORT else "RESULTS_small_scale.md"


def _grid_names(parser: argparse.ArgumentParser, value: str) -> list[str]:
  """``--grid``'s grids, in order; refused in one line: a name that is not a grid, or grids
  of different reports."""
  names = [name.strip() for name in value.split(",")]
  for name in names:
    if name not in grids.GRIDS:
      parser.error(f"--grid={value}: {name!r} is not a grid; allowed: "
                   f"{', '.join(sorted(grids.GRIDS))}, or several of one report, "
                   "comma-separated")
  reports = {name: _report(name) for name in names}
  if len(set(reports.values())) > 1:
    parser.error(f"--grid={value}: grids of one report only, here "
                 + ", ".join(f"{name} ({report})" for name, report in reports.items()))
  return names


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.reproduce",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--grid", default="paper",
                      help="the grid (experiments/grids.py), or grids of one report, comma-"
                           "separated: their runs in that order, so that with --deadline the "
                           "later grids' runs fill the time that none of the earlier ones "
                           f"fits ({', '.join(sorted(grids.GRIDS))})")
  parser.add_argument("--out", required=True, help="folder for the runs (resumable)")
  parser.add_argument("--corpus", default="", help="debian_docs corpus folder (paper grid)")
  parser.add_argument("--only", default="", help="run only the runs whose name matches")
  parser.add_argument("--results", default="",
                      help="RESULTS.md to write (default: experiments/RESULTS.md for the paper "
                           "grid, OUT/RESULTS.md otherwise)")
  parser.add_argument("--jobs", type=int, default=0,
                      help="runs at a time, each a process on its own cores (0: one per core "
                           "this process may use; 1: one after another in this process)")
  parser.add_argument("--digests", default="",
                      help="folder of the finished runs' digests, which RESULTS.md is written "
                           "from (default: experiments/results, or OUT/results for the smoke "
                           "grid)")
  parser.add_argument("--commit", action="store_true",
                      help="commit each finished run's digest to git as it is written (only "
                           "the digests folder), so that a grid spanning sessions keeps its "
                           "results")
  parser.add_argument("--isolate", action="store_true",
                      help="each run in a process of its own (pinned, logs in OUT/logs) also "
                           "with --jobs=1: for a grid that runs for days in the background")
  parser.add_argument("--prune", action="store_true",
                      help="delete each finished run's checkpoints but its newest (its final "
                           "state), so that a long grid does not fill the disk")
  parser.add_argument("--deadline", type=float, default=0.0,
                      help="seconds from now by which every run started must end (0: no "
                           "limit): a run starts only if the finished runs of its size say it "
                           "ends by then (the first queued one that does), for a machine "
                           "leased until a known time: a run cut off is lost with it")
  parser.add_argument("--prepare-only", action="store_true",
                      help="build the corpus and BPE vocabularies the chosen runs read (into "
                           "OUT/corpus; with --corpus, the vocabularies it lacks) and stop: "
                           "for a machine that runs the grid offline")
  parser.add_argument("--report-only", action="store_true",
                      help="write RESULTS.md from the finished runs without running any")
  args = parser.parse_args(argv)
  if args.jobs < 0:
    parser.error(f"--jobs={args.jobs} is not allowed; allowed: 0 (one per core) or more")
  if not args.deadline >= 0:
    parser.error(f"--deadline={args.deadline} is not allowed; allowed: seconds >= 0 (0: none)")
  deadline = time.monotonic() + args.deadline if args.deadline else float("inf")
  names = _grid_names(parser, args.grid)

  import jax  # pylint: disable=g-import-not-at-top

  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  os.makedirs(args.out, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

  report = _report(names[0])  # every grid's (_grid_names)
  smoke = report == "smoke"
  results_dir = args.digests or (os.path.join(args.out, "results") if smoke
                                 else os.path.join(_HERE, "results"))
  runs = list(dict.fromkeys(run for name in names for run in grids.grid(name)))
  chosen = [r for r in runs if re.search(args.only, r.name)] if args.only else runs
  todo, finished = [], []
  for run in chosen:
    workdir = os.path.join(args.out, "runs", run.name)
    if not os.path.exists(analysis.digest_path(results_dir, run)):
      if not os.path.exists(os.path.join(workdir, "summary.json")):
        todo.append(run)
        continue
      analysis.write_digest(workdir, results_dir, run)  # finished before digests were kept
    if args.prune and not args.report_only:
      prune_checkpoints(workdir)
    finished.append(run)
  print(f"reproduce: grid {args.grid}: {len(chosen)} runs, {len(chosen) - len(todo)} already "
        f"finished", file=sys.stderr)
  if args.prepare_only:
    needed = [r for r in chosen if r.needs_corpus()]
    print(f"reproduce: the corpus is {_corpus(args.corpus, args.out, needed)}" if needed else
          "reproduce: these runs read no corpus", file=sys.stderr)
    return 0
  if args.report_only:
    todo = []
  todo, started = resumes_first(todo, args.out)
  if started:
    print(f"reproduce: {len(started)} resume from their checkpoints first: " + ", ".join(
        f"{name} at {share:.0%}" for name, share in started.items()), file=sys.stderr)
  data_path = _corpus(args.corpus, args.out, todo) if any(
      r.needs_corpus() for r in todo) else ""
  jobs = args.jobs or len(_cores())
  timed = []  # the finished runs' training times, for the time left and --deadline
  for run in finished if todo else ():
    with open(analysis.digest_path(results_dir, run)) as f:
      timed.append((run, json.load(f)["summary"].get("wall_seconds", 0.0)))
  if (jobs > 1 or args.isolate) and todo:
    status = run_parallel(todo, args.out, data_path, results_dir, jobs, commit=args.commit,
                          timed=timed, prune=args.prune, deadline=deadline, started=started)
    if status != 0:
      return status
  failed = []
  serial = list(todo) if jobs == 1 and not args.isolate else []
  progress = Progress(serial, 1, timed, started)
  while serial:
    index = next_fitting(serial, progress, deadline)
    if index is None:
      _left_for_later(serial, deadline)
      break
    _start_first(serial, index, progress)
    run = serial.pop(index)
    workdir = os.path.join(args.out, "runs", run.name)
    print(f"reproduce: [{progress.done + 1}/{progress.total}] {run.name}; {progress.eta()}",
          file=sys.stderr, flush=True)
    status = train.main([f"--workdir={workdir}", *run.args(data_path)])
    if status in (130, 143):  # Ctrl-C or SIGTERM: stopped at a checkpoint
      print(f"reproduce: {run.name} stopped (exit {status}); re-run the same command to resume",
            file=sys.stderr)
      return status
    if status != 0:  # e.g. a diverged run (a high outer lr): the queue goes on without it
      failed.append(run.name)
      progress.finished(run, 0.0)  # counted, not timed
      print(f"reproduce: {run.name} failed (exit {status}); the next run starts",
            file=sys.stderr, flush=True)
      continue
    finish(run, args.out, results_dir, args.commit, args.prune)
    with open(os.path.join(workdir, "summary.json")) as f:
      progress.finished(run, json.load(f)["wall_seconds"])
  if failed:
    print(f"reproduce: {len(failed)} runs failed: {', '.join(failed)}; re-run the command to "
          "retry them (finished runs are skipped)", file=sys.stderr)
    return 1

  # RESULTS.md reports every finished run of this scale found (tuning, paper grid, PALSGD,
  # ablations; or the issue-18 grids), whichever grid this command ran.
  family = list(dict.fromkeys(run for name in names for run in grids.family(name)))
  results = analysis.load(args.out, family, results_dir)
  # One RESULTS.md (grids.ONE_REPORT): issues 34, 35 and 80's runs in sections of their own.
  one_report = report == "RESULTS.md"
  path = args.results or (os.path.join(args.out, "RESULTS.md") if smoke else os.path.join(
      _HERE, "RESULTS.md" if one_report else "RESULTS_small_scale.md"))
  fig_dir = os.path.join(os.path.dirname(os.path.abspath(path)), "figures",
                         *(["science"] if one_report else []))
  command = f"python -m experiments.reproduce --grid={args.grid} --out=DIR"
  if one_report:  # issues 34, 35 and 80's grids in sections of their own
    streamed, chaotic = set(grids.grid("streaming")), set(grids.grid("chaos"))
    aggregated = set(grids.grid("faulty") + grids.grid("merge_order"))
    reported = set(family) - streamed - chaotic - aggregated
    on_gpu = set(grids.grid("scale"))  # RESULTS.md counts the scale grid's runs apart
    dates = _digest_dates(results_dir)
    science.write_results(
        [r for r in results if r.run in reported], path, fig_dir, command,
        _scale_note("science"),
        sections=streaming.sections([r for r in results if r.run in streamed], fig_dir, path)
        + chaos.sections([r for r in results if r.run in chaotic], fig_dir, path)
        + aggregation.sections([r for r in results if r.run in aggregated], dates),
        planned=len(reported - on_gpu), dates=dates)
  else:
    analysis.write_results(results, path, fig_dir, command, _scale_note(names[0]))
  analysis.write_index(results, path)
  print(f"reproduce: {len(results)}/{len(family)} runs finished; wrote {path} and {fig_dir}/",
        file=sys.stderr)
  return 0


def _digest_dates(results_dir: str) -> Optional[dict[str, float]]:
  """The digests' dates for the claims table's *rule* column (``science.digest_dates``), with a
  warning when git cannot give them (the column then says the rows are not dated)."""
  dates = science.digest_dates(results_dir)
  if dates is None:
    print(f"reproduce: no full git history of {results_dir} (not a repository, or a shallow "
          "clone: git fetch --unshallow): the claims table's rule column says 'not dated'",
          file=sys.stderr)
  return dates


if __name__ == "__main__":
  sys.exit(main())
