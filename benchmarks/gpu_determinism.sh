#!/usr/bin/env bash
# Issue 59 item 2 on a GPU: which way of running deterministically keeps bfloat16's speed,
# and does it replay bit for bit? Run from the repository root (OUT defaults to
# ./gpu_results; PARTS="speed replay" by default: 6 processes of at most 150 s, then 8 of at
# most 120 s; run them as two calls where a call's time is short).
#   speed:  benchmarks/device_step.py, the 86M GPT's bfloat16 inner loop only, one after
#           another in this run, under XLA_FLAGS
#             none | --xla_gpu_exclude_nondeterministic_ops (deterministic kernels,
#             autotuning kept) | --xla_gpu_deterministic_ops (the same, autotuning off)
#           × model.attention xla | cudnn (cuDNN's flash kernel; under the flags XLA asks
#           cuDNN for its deterministic backward, which jax 0.11.2 could not compile).
#           Prints tokens/s and each setting ÷ the fastest non-deterministic one.
#   replay: the bfloat16 quickstart twice per deterministic recipe, each run a fresh process
#           with JAX's compilation cache off (XLA compiles, and autotunes, anew); the
#           exclude recipe persists its autotuning picks in a per-fusion cache that the
#           second run reads. Prints whether the two runs' losses agree bit for bit.
# The figures decide docs/DESIGN.md "Determinism": a recipe at >= 0.8x that replays becomes
# the CLI's bfloat16 default (harness.deterministic); otherwise bfloat16 stays off.
set -uo pipefail
OUT=${OUT:-gpu_results}/determinism
PARTS=${PARTS:-speed replay}
mkdir -p "$OUT"
EXCLUDE=--xla_gpu_exclude_nondeterministic_ops=true
OPS=--xla_gpu_deterministic_ops=true
nvidia-smi -L
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

if [[ " $PARTS " == *" speed "* ]]; then
  for recipe in none exclude ops; do
    case $recipe in none) flags="";; exclude) flags=$EXCLUDE;; ops) flags=$OPS;; esac
    for attention in xla cudnn; do
      XLA_FLAGS="$flags" timeout 150 python3 benchmarks/device_step.py --dtypes bfloat16 \
        --no-outer --repeats 5 --attention $attention > "$OUT/speed_${recipe}_$attention.txt" 2>&1
      echo "speed $recipe $attention: exit $?"
    done
  done
  python3 - "$OUT" <<'PY'
import json, os, sys
rows = {}
for recipe in ("none", "exclude", "ops"):
  for attention in ("xla", "cudnn"):
    path = os.path.join(sys.argv[1], f"speed_{recipe}_{attention}.txt")
    lines = [l for l in open(path, errors="replace") if l.startswith("RESULT ")]
    rows[recipe, attention] = json.loads(lines[-1][7:])["inner"]["tokens_per_s"] if lines else None
base = max((v for (r, _), v in rows.items() if r == "none" and v), default=None)
print("## bfloat16 inner loop, 86M GPT (tokens/s; ÷ the fastest without deterministic ops)")
for (recipe, attention), value in rows.items():
  print(f"{recipe:8s} {attention:6s} " + (f"{value:10.0f}  {value / base:.2f}x" if value and base
                                          else "did not run (see its file)"))
PY
fi

if [[ " $PARTS " == *" replay "* ]]; then
  for recipe in ops_xla ops_cudnn exclude_xla exclude_cudnn; do
    attention=${recipe#*_}
    case $recipe in
      ops_*) flags=$OPS;;
      exclude_*) flags="$EXCLUDE --xla_gpu_per_fusion_autotune_cache_dir=$OUT/autotune_$attention"
                 mkdir -p "$OUT/autotune_$attention";;
    esac
    for run in 1 2; do
      rm -rf "$OUT/replay_${recipe}_$run"
      XLA_FLAGS="$flags" timeout 120 python3 -m heloco_jax.cli.train \
        --workdir="$OUT/replay_${recipe}_$run" --compilation_cache= \
        --config.model.compute_dtype=bfloat16 --config.model.attention=$attention \
        --config.deterministic=false --config.budget.tokens=300000 --config.quiet=true \
        > "$OUT/replay_${recipe}_$run.txt" 2>&1
      echo "replay $recipe run $run: exit $? $(tail -1 "$OUT/replay_${recipe}_$run.txt")"
    done
    python3 - "$OUT/replay_${recipe}_1/metrics.jsonl" "$OUT/replay_${recipe}_2/metrics.jsonl" \
      "$recipe" <<'PY'
import json, sys
def losses(path):  # every float of every row (losses, cosines, λ, β): no wall-clock fields
  try:
    rows = [json.loads(line) for line in open(path)]
  except OSError:
    return None
  return [(r["event"], k, v) for r in rows for k, v in sorted(r.items())
          if isinstance(v, float)]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
verdict = ("did not run" if a is None or b is None else
           "bit for bit" if a == b else
           f"differ at {sum(x != y for x, y in zip(a, b))} of {len(a)} values")
print(f"## replay {sys.argv[3]}: {verdict}")
PY
  done
fi
