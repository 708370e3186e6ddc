#!/usr/bin/env bash
# Issue 60's scale grid (`--grid=scale`, 24 runs) on a leased GPU, a few runs per call; each
# finished run's digest comes back in the call's $OUT (experiments/README.md, "Issue 60's grids").
#   here, once: bash experiments/gpu_scale.sh prepare     # the corpus into .scale/corpus (Debian
#                                                          # packages, a minute), wheels into .whl
#   there:      bash experiments/gpu_scale.sh             # carry .scale/corpus and .whl
#   back here:  bash experiments/gpu_scale.sh import DIR  # DIR: the call's files_at; its new
#                                                          # digests into experiments/results, committed
# There, runs whose digest is committed here are skipped and a run starts only if it is
# expected to end within DEADLINE seconds (default 480, for a 600 s call; the first of its
# size always starts): a run cut off with the machine is lost, not resumed.
# ONLY (a regex of run names) picks runs, as --only does; CORPUS (prepare) copies that corpus
# folder instead of building one.
set -euo pipefail
case "${1:-run}" in
prepare)
  python -m experiments.reproduce --grid=scale --out=.scale --prepare-only \
    ${CORPUS:+--corpus="$CORPUS"}
  if [[ -n "${CORPUS:-}" ]]; then rm -rf .scale/corpus && cp -r "$CORPUS" .scale/corpus; fi
  if [[ -x ../shared/gpu/wheels.sh ]]; then bash ../shared/gpu/wheels.sh > /dev/null; fi
  du -sh .scale/corpus .whl 2>/dev/null || true
  ;;
run)
  OUT=${OUT:-.scale/out}
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
  fi
  mkdir -p "$OUT/digests"
  if [[ -d experiments/results/scale ]]; then cp -r experiments/results/scale "$OUT/digests/"; fi
  nvidia-smi -L 2>/dev/null || true
  python3 -m experiments.reproduce --grid=scale --out=/tmp/scale_runs --corpus=.scale/corpus \
    --jobs=1 --digests="$OUT/digests" --results="$OUT/RESULTS.md" --deadline="${DEADLINE:-480}" \
    --only="${ONLY:-}" > "$OUT/scale.log" 2>&1 || echo "reproduce exited $?"
  grep -E "^reproduce" "$OUT/scale.log" || tail -20 "$OUT/scale.log"
  find "$OUT/digests" -name '*.json' | sort
  ;;
import)
  src=${2:?"usage: bash experiments/gpu_scale.sh import DIR (the call's files_at)"}
  [[ -d "$src/digests/scale" ]] || { echo "no digests under $src/digests/scale"; exit 1; }
  cp -r "$src/digests/scale" experiments/results/
  git add experiments/results/scale
  git commit -q -m "experiments/results: scale grid digests from a GPU lease" \
    -- experiments/results/scale || echo "nothing new to commit"
  find experiments/results/scale -name '*.json' | wc -l
  ;;
*) echo "usage: bash experiments/gpu_scale.sh [prepare|run|import DIR]"; exit 2 ;;
esac
