"""Runs a grid of ``experiments/grids.py`` and writes its RESULTS.md and figures.

  python -m experiments.reproduce --grid=paper --out=DIR [--corpus=PATH] [--only=REGEX]
  python -m experiments.reproduce --grid=all --out=DIR        # + tuning, PALSGD, ablations
  python -m experiments.reproduce --grid=smoke --out=DIR      # a few minutes, synthetic data

Each run is ``heloco-jax train`` in ``OUT/runs/<name>``, in this process (one
JAX start-up; compiled programs are cached in ``OUT/xla_cache``). Finished runs
(with a summary.json) are skipped and interrupted ones resume from their
checkpoints, so the same command continues a grid after any interruption.
The paper grid reads the debian_docs corpus (de, en, es, fr, it); it is built
into ``OUT/corpus`` when ``--corpus`` is not given (``heloco-jax corpus``,
about a minute, Debian packages only).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Optional, Sequence

from experiments import analysis, grids

_HERE = os.path.dirname(os.path.abspath(__file__))


def _corpus(path: Optional[str], out: str) -> str:
  """An existing corpus folder, or one built into OUT/corpus."""
  if path:
    if not os.path.isdir(path):
      raise SystemExit(f"reproduce: --corpus={path!r} is not a directory")
    return path
  path = os.path.join(out, "corpus")
  if not os.path.exists(os.path.join(path, "manifest.json")):
    from heloco_jax import cli  # pylint: disable=g-import-not-at-top
    print(f"reproduce: building the debian_docs corpus into {path}", file=sys.stderr)
    if cli.main(["corpus", "debian_docs", f"--languages={grids.LANGUAGES}",
                 f"--out={path}"]) != 0:
      raise SystemExit("reproduce: the corpus could not be built; pass --corpus=DIR (a folder "
                       "of text per language) instead")
  return path


def _scale_note(name: str) -> str:
  scale = grids.SCALES[name]
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


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.reproduce",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--grid", default="paper", choices=sorted(grids.GRIDS))
  parser.add_argument("--out", required=True, help="folder for the runs (resumable)")
  parser.add_argument("--corpus", default="", help="debian_docs corpus folder (paper grid)")
  parser.add_argument("--only", default="", help="run only the runs whose name matches")
  parser.add_argument("--results", default="",
                      help="RESULTS.md to write (default: experiments/RESULTS.md for the paper "
                           "grid, OUT/RESULTS.md otherwise)")
  args = parser.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  from heloco_jax import train  # pylint: disable=g-import-not-at-top
  os.makedirs(args.out, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

  runs = grids.grid(args.grid)
  chosen = [r for r in runs if re.search(args.only, r.name)] if args.only else runs
  needs_text = any(dict(r.overrides).get("data.source") == "text_dir" for r in chosen)
  data_path = _corpus(args.corpus, args.out) if needs_text else ""
  todo = [r for r in chosen if not os.path.exists(
      os.path.join(args.out, "runs", r.name, "summary.json"))]
  print(f"reproduce: grid {args.grid}: {len(chosen)} runs, {len(chosen) - len(todo)} already "
        f"finished", file=sys.stderr)
  start = time.perf_counter()
  for i, run in enumerate(todo):
    workdir = os.path.join(args.out, "runs", run.name)
    elapsed = time.perf_counter() - start
    eta = f", about {elapsed / i * (len(todo) - i) / 60:.1f} min left" if i else ""
    print(f"reproduce: [{i + 1}/{len(todo)}] {run.name}{eta}", file=sys.stderr)
    status = train.main([f"--workdir={workdir}", *run.args(data_path)])
    if status != 0:
      print(f"reproduce: {run.name} failed (exit {status}); re-run the same command to resume",
            file=sys.stderr)
      return status

  # RESULTS.md reports every finished run of this scale found in OUT (tuning, paper grid,
  # PALSGD, ablations), whichever grid this command ran.
  family = grids.family(args.grid)
  results = analysis.load(args.out, family)
  paper_scale = grids.SCALES[args.grid] is grids.PAPER
  path = args.results or (os.path.join(_HERE, "RESULTS.md") if paper_scale
                          else os.path.join(args.out, "RESULTS.md"))
  fig_dir = os.path.join(os.path.dirname(os.path.abspath(path)), "figures")
  command = f"python -m experiments.reproduce --grid={args.grid} --out=DIR"
  analysis.write_results(results, path, fig_dir, command, _scale_note(args.grid))
  print(f"reproduce: {len(results)}/{len(family)} runs finished; wrote {path} and {fig_dir}/",
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
