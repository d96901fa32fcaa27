#!/usr/bin/env bash
# The CUDA path on one GPU, in one go, within about 8 minutes on one H200:
#   1. the gpu tests (tests/gpu: K3 forward/backward on CUDA against the CPU, the fused decode
#      engine against the model forward, a learner step on CUDA against the CPU, 2-step runs);
#   2. the decode benchmark on the GPU: K3Policy against transformers' generate (ratios);
#   3. the learner benchmark on the GPU: our learner step against TRL's GRPO step (ratio);
#   4. a 10-step quickstart with the learner and SFT on the GPU (rollout.device auto: the
#      workers get GPUs only if there is one for each after the learner's), its seconds per
#      step against the 2-core CPU figure in docs/benchmarks.md (2.83 s/step).
# Then a summary. Without a GPU it says so and exits 0.
#
#   bash benchmarks/gpu_check.sh        # from the repository root, after `make setup`
#
# Every step runs under `timeout`; the whole check stays within GPU_CHECK_SECONDS (default 465):
# a step gets at most what is left, and is skipped when that is under GPU_CHECK_MIN_STEP_S
# (default 30). Logs go to GPU_CHECK_OUT (default runs/gpu-check-<time>).
# VENV names the virtualenv (default .venv, as in the Makefile).
# Exit status: 0 every step passed (or no GPU), 1 a step failed or ran out of time, 2 not set up.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
BUDGET="${GPU_CHECK_SECONDS:-465}"
MIN_STEP="${GPU_CHECK_MIN_STEP_S:-30}"
QUICKSTART_CPU_S_PER_STEP=2.83 # docs/benchmarks.md, "Async vs sync": quickstart, sync, 2 cores

gpus() { # NVIDIA GPUs the driver lists (0 without a driver)
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  elif [ -e /dev/nvidia0 ]; then
    echo 1
  else
    echo 0
  fi
}

if [ "$(gpus)" -eq 0 ]; then
  echo "gpu_check: no GPU on this machine (nvidia-smi lists none, no /dev/nvidia0): nothing to check"
  exit 0
fi
if [ ! -x "$PY" ]; then
  echo "gpu_check: $PY not found: run \`make setup\` first (or set VENV)" >&2
  exit 2
fi
if ! timeout 120 "$PY" - <<'PY'; then
import sys, torch
ok = torch.cuda.is_available()
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), "
      + (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if ok else "sees no GPU"))
sys.exit(0 if ok else 1)
PY
  echo "gpu_check: the driver lists a GPU but torch in $VENV cannot use it: install a CUDA" \
    "build of torch 2.13.0 there (a +cpu build, as from a CPU-only index, has no CUDA; check" \
    "pip's index settings, then \`$PY -m pip install --force-reinstall torch==2.13.0\`)" >&2
  exit 2
fi

out="${GPU_CHECK_OUT:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
start=$SECONDS
failed=0
results=()

# run_step NAME LIMIT COMMAND...: COMMAND under timeout (LIMIT, or less if the budget is short),
# its output shown and kept in $out/NAME.log.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - start)))
  ((limit > left)) && limit=$left
  if ((limit < MIN_STEP)); then
    results+=("$name: SKIPPED (the ${BUDGET} s budget is spent)")
    failed=1
    return
  fi
  echo
  echo "=== $name (at most ${limit} s)"
  local t0=$SECONDS
  timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]} took=$((SECONDS - t0))
  if ((rc == 0)); then
    results+=("$name: ok in ${took} s")
  elif ((rc == 124 || rc == 137)); then
    results+=("$name: TIMED OUT after ${took} s")
    failed=1
  else
    results+=("$name: FAILED (exit $rc) after ${took} s")
    failed=1
  fi
}

run_step gpu-tests 200 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu
run_step decode 75 "$PY" benchmarks/decode_speed.py --device cuda --batches 1 16 --threads 0 \
  --prompt-len 128 --new-tokens 64 --repeats 2 --no-prefill-table
run_step learner 60 "$PY" benchmarks/learner_speed.py --device cuda --repeats 3
run_step quickstart 240 "$VENV/bin/agentrl" train configs/quickstart.yaml trainer.steps=10 \
  trainer.device=cuda rollout.device=cuda "trainer.resources={GPU: 0.5}" \
  "rollout.resources={GPU: 0.25}" eval.tasks=50 name=quickstart-gpu "output_dir=$out/runs"

echo
echo "=== summary ($((SECONDS - start)) s; logs in $out)"
printf '%s\n' "${results[@]}"
if [ -f "$out/decode.log" ]; then
  echo
  echo "decode on the GPU (ours / this > 1: K3Policy is faster):"
  grep '^|' "$out/decode.log" || true
fi
if [ -f "$out/learner.log" ]; then
  echo
  echo "learner step on the GPU (vs TRL > 1: ours is faster):"
  grep '^|' "$out/learner.log" || true
fi
run_dir=$(ls -d "$out"/runs/quickstart-gpu-* 2>/dev/null | head -1)
if [ -n "$run_dir" ] && [ -f "$run_dir/metrics.jsonl" ]; then
  echo
  grep -E 'devices: |after (SFT|GRPO)' "$out/quickstart.log" || true
  "$PY" - "$run_dir/metrics.jsonl" "$QUICKSTART_CPU_S_PER_STEP" <<'PY'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
train = [r for r in rows if r.get("phase") == "train" and r["step"] > 1]  # step 1: warm-up
if train:
    mean = lambda key: sum(r.get(key, 0.0) for r in train) / len(train)
    step, cpu = mean("step/seconds"), float(sys.argv[2])
    print(f"quickstart steps 2-{train[-1]['step']}: {step:.2f} s/step (rollout "
          f"{mean('rollout/seconds'):.2f} s, learner {mean('learner/seconds'):.2f} s, push "
          f"{mean('weights/push_seconds'):.3f} s); the 2-core CPU quickstart: {cpu:.2f} s/step, "
          f"{cpu / step:.2f}x")
PY
fi
exit $failed
