#!/usr/bin/env bash
# The GPU figures of the performance issue in one go (run from the repository root on a
# machine with a GPU; OUT defaults to ./gpu_results):
#   1. benchmarks/device_step.py, inner loop in float32 and bfloat16 + outer step, twice:
#      with XLA's deterministic GPU ops off and on (their cost, side by side); then
#      benchmarks/leaf_sums.py (the packed server's per-leaf sums, three ways);
#   2. the quickstart in float32 and in bfloat16 (loss curves from metrics.jsonl), each with
#      the CLI's default: XLA's deterministic ops on in float32, off in bfloat16;
#   3. ours beside PyTorch bf16 + torch.compile on the same card, one after the other in this
#      run, at the project's GPT (byte vocabulary) and at GPT-2-124M's shape (vocab 50257,
#      context 1024): tokens/s, ours ÷ PyTorch and both MFUs (where torch with CUDA is installed).
# benchmarks/gpu_determinism.sh then measures the deterministic recipes in bfloat16 (issue 59).
# PARTS="device quickstart versus" (the default) picks them: each part writes its files under
# OUT as it goes, so a call cut off by its time limit keeps what finished; the versus part
# runs 4 processes of up to 400 / 300 s, so give it a call of its own where calls are short.
set -uo pipefail
OUT=${OUT:-gpu_results}
PARTS=${PARTS:-device quickstart versus}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
if [[ " $PARTS " == *" device "* ]]; then
XLA_FLAGS= timeout 240 python3 benchmarks/device_step.py > "$OUT/device_step.txt" 2>&1
grep -v '^RESULT' "$OUT/device_step.txt" | tail -45
XLA_FLAGS=--xla_gpu_deterministic_ops=true timeout 240 python3 benchmarks/device_step.py \
  > "$OUT/device_step_deterministic.txt" 2>&1
echo "## deterministic ops on"; grep -E "tokens/s|ms/update|side by side" "$OUT/device_step_deterministic.txt"
XLA_FLAGS= timeout 120 python3 benchmarks/leaf_sums.py > "$OUT/leaf_sums.txt" 2>&1
echo "## the packed server's per-leaf sums"; grep -E " ms" "$OUT/leaf_sums.txt"
fi
[[ " $PARTS " == *" quickstart "* ]] && for dtype in float32 bfloat16; do
  timeout 200 python3 -m heloco_jax.cli.train --workdir="$OUT/quickstart_$dtype" \
    --config.model.compute_dtype=$dtype 2>&1 | tail -1
  python3 - "$OUT/quickstart_$dtype/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(" ".join(f"{r['tokens'] // 1000}k:{r['val_loss']:.3f}" for r in rows if r["event"] == "eval"))
PY
done
if [[ " $PARTS " != *" versus "* ]]; then
  :
elif python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  for vocab in 257 50257; do
    timeout 400 python3 benchmarks/torch_gpt_step.py --vocab $vocab > "$OUT/torch_$vocab.txt" 2>&1
    grep -E "^# torch|tokens/s" "$OUT/torch_$vocab.txt"
    XLA_FLAGS= timeout 300 python3 benchmarks/device_step.py --vocab $vocab --dtypes bfloat16 \
      --no-outer --versus "$OUT/torch_$vocab.txt" > "$OUT/ours_vs_torch_$vocab.txt" 2>&1
    grep -E "^ours|tokens/s  " "$OUT/ours_vs_torch_$vocab.txt"
  done
else
  echo "## ours vs PyTorch: skipped (no torch with CUDA on this machine)"
fi
