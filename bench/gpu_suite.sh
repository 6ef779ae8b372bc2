#!/usr/bin/env bash
# Everything gpt3d measures on a GPU, in one command: the CUDA tests, then every GPU benchmark.
# Writes bench/results/<gpu>-<date>.md (or into the folder given as $1): the device, driver, library
# versions, each exact command and its unedited output.
#
#   bash bench/gpu_suite.sh             # → bench/results/NVIDIA-H100-80GB-HBM3-2026-11-22.md
#   PYTHON=.venv/bin/python bash bench/gpu_suite.sh /tmp/results
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${1:-bench/results}"
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

section() {  # section TITLE COMMAND...: run one command, append it and its output to the results file
  local title="$1"; shift
  echo "== $title: $*" >&2
  local start=$SECONDS
  {
    echo; echo "## $title"; echo; echo "\`$*\`"; echo; echo '```'
    "$@" 2>&1
    local rc=$?
    echo '```'
    echo; echo "exit code $rc, $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || echo "FAILED" >&2
    exit "$rc"
  } | tee -a "$RESULT"
  [ "${PIPESTATUS[0]}" -eq 0 ] || FAILED=1
}

{
  echo "# gpt3d GPU suite on $GPU, $(date -u '+%F %H:%M UTC')"
  echo
  echo "Command: \`bash bench/gpu_suite.sh\` at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
props = torch.cuda.get_device_properties(0)
print(f"{props.name}: {props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
for name in ("triton", "deepspeed", "transformers", "hydra", "datasets"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as err:  # report what is missing, measure the rest
        print(name, "unavailable:", type(err).__name__)
EOF
  echo '```'
} > "$RESULT"

section "CUDA tests" "$PY" -m pytest -q -p no:cacheprovider tests/test_attention_cuda.py
section "Attention kernel vs SDPA" "$PY" -m bench.attention

echo "gpu_suite: results in $RESULT" >&2
exit "$FAILED"
