#!/usr/bin/env bash
# Everything gpt3d measures on a GPU, in one command: the CUDA tests, then every GPU benchmark.
# Writes DIR/<gpu>-<date>.md (DIR defaults to bench/results) while it runs: the device, driver and
# library versions, then each section's exact command and unedited output, appended as it comes;
# the attention and training-speed benchmarks' rows also as JSON beside it (DIR/<gpu>-<date>-attention.json,
# DIR/<gpu>-<date>-train-speed.json, DIR/<gpu>-<date>-train-speed-large.json), and the recovery checks'
# records (DIR/<gpu>-<date>-recovery.json).
# Every section has a time limit and the whole suite a deadline (SUITE_SECONDS, default 560 s,
# under a 10-minute job limit): a section that fails or runs out of time is recorded as such and
# the next one still runs; whatever was finished stays in the file even if the suite is killed.
# The default deadline reaches the first training-speed section; SUITE_SECONDS=1800 runs them all.
#
#   bash bench/gpu_suite.sh                 # → bench/results/NVIDIA-H100-80GB-HBM3-2026-11-22.md
#   PYTHON=.venv/bin/python bash bench/gpu_suite.sh /tmp/results
#   SUITE_SECONDS=1800 bash bench/gpu_suite.sh   # a machine with more time: same sections, same limits
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${1:-bench/results}"
DEADLINE=$((SECONDS + ${SUITE_SECONDS:-560}))
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_suite: no CUDA device visible to $PY; nothing to measure" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
GPU="$("$PY" -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")"
RESULT="$OUT_DIR/$GPU-$(date +%F).md"
FAILED=0

section() {  # section TITLE SECONDS COMMAND...: run COMMAND for at most SECONDS, appending to RESULT
  local title="$1" limit="$2"; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  [ "$limit" -le "$left" ] || limit=$left
  printf '\n## %s\n\n`%s` (time limit %s s)\n\n' "$title" "$*" "$limit" >> "$RESULT"
  if [ "$limit" -lt 20 ]; then
    echo "SKIPPED: the suite's deadline leaves ${limit} s" | tee -a "$RESULT" >&2
    FAILED=1
    return
  fi
  echo "== $title ($limit s): $*" >&2
  local start=$SECONDS
  echo '```' >> "$RESULT"
  # SIGINT first: pytest then prints the summary of the tests it finished; KILL 15 s later.
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$RESULT"
  local rc=${PIPESTATUS[0]}
  echo '```' >> "$RESULT"
  local verdict="exit code $rc"
  [ "$rc" -eq 124 ] && verdict="TIMED OUT after $limit s (exit code 124)"
  [ "$rc" -ne 0 ] && verdict="FAILED: $verdict" && FAILED=1
  printf '\n%s, %s s\n' "$verdict" "$((SECONDS - start))" | tee -a "$RESULT" >&2
}

{
  echo "# gpt3d GPU suite on $GPU, $(date -u '+%F %H:%M UTC')"
  echo
  commit="$(git rev-parse --short HEAD 2>/dev/null)" && { git diff --quiet HEAD || commit="$commit (with uncommitted changes)"; }
  echo "Command: \`SUITE_SECONDS=${SUITE_SECONDS:-560} bash bench/gpu_suite.sh $*\` at commit ${commit:-unknown (no git)}"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1
  "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version())
props = torch.cuda.get_device_properties(0)
print(f"{props.name}: {props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
for name in ("triton", "transformers", "deepspeed", "hydra", "datasets", "torchao"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as err:  # report what is missing, measure the rest
        print(name, "unavailable:", type(err).__name__)
EOF
  echo '```'
} > "$RESULT"

section "CUDA tests (autotuning pinned to each kernel's first config)" 170 \
  env GPT3D_TRITON_AUTOTUNE=0 "$PY" -m pytest -q -p no:cacheprovider -rfEs --durations=5 tests/model/test_attention_cuda.py
section "Attention kernel vs SDPA backends" 210 "$PY" -m bench.attention --json "${RESULT%.md}-attention.json"
section "Training step: gpt3d (Triton kernel, SDPA, DeepSpeed engine by precision: autocast, bf16, fp8 tensorwise and rowwise) vs Hugging Face GPT-2" 240 \
  "$PY" -m bench.train_speed model=gpt3-125m model=gpt3-350m --json "${RESULT%.md}-train-speed.json"
section "Training step, larger models (micro batch 8 for 760m, 2 for 1.3b)" 420 \
  "$PY" -m bench.train_speed model=gpt3-760m model=gpt3-1.3b --json "${RESULT%.md}-train-speed-large.json"
section "One tensor-parallel rank's block, measured vs the planner (gpt3-175b at tp=8, gpt3-13b at tp=2)" 120 \
  bash -c "'$PY' -m bench.shard model=gpt3-175b parallel.tp=8 train.micro_batch_size=1 && '$PY' -m bench.shard model=gpt3-13b parallel.tp=2 train.micro_batch_size=1"
section "Profile: where a step of gpt3-125m goes (python -m train's loop, bf16, micro batch 8)" 240 \
  "$PY" -m bench.profile model=gpt3-125m train.micro_batch_size=8 train.global_batch_size=8 \
  --run-dir "${RESULT%.md}-profile"
section "Recovery: kill -9 and resume (bit-exact), SIGTERM, skipped non-finite steps, batch ramp, checkpoint GB/s, async vs sync pause (gpt3-125m, seq 512)" 240 \
  "$PY" -m bench.recovery --device cuda --json "${RESULT%.md}-recovery.json"

echo "gpu_suite: results in $RESULT" >&2
exit "$FAILED"
