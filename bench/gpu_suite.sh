#!/usr/bin/env bash
# Everything gpt3d measures on a GPU, in sections that each end well inside 9 minutes, in an order
# that fits six jobs of a 10-minute slot (docs/benchmarks.md: "A plan for a short GPU slot").
#
#   bash bench/gpu_suite.sh --list                                          # sections, limits, jobs
#   bash bench/gpu_suite.sh --only cuda-tests,train-small,step-65k,profile  # job 1: the headline figures
#   bash bench/gpu_suite.sh --only train-large                              # job 2
#   bash bench/gpu_suite.sh --only recovery-exact,recovery-paths            # job 3
#   bash bench/gpu_suite.sh --only fp8-products,shard,fp8-large             # job 4: float8 where it pays
#   bash bench/gpu_suite.sh --only attention,attention-sweep                # job 5: the attention kernel, its configs
#   bash bench/gpu_suite.sh --only attention-band                           # job 6: GPT-3's banded layers
#   bash bench/gpu_suite.sh --only attention --dry-run                      # the commands, not run
#   bash bench/gpu_suite.sh                                                 # every section, to the deadline
#   bash bench/gpu_suite.sh --only shard /tmp/results                       # results into another folder
#
# Results go to DIR/<gpu>-<UTC date>.md (DIR defaults to bench/results), one file per day: each run
# appends a job header (its command, the commit, the device, driver and library versions), then each
# section's exact command and unedited output with its exit code and duration, as it runs; rows also
# go to JSON beside it (<gpu>-<date>-<section>.json); fp8-products writes the GPU's float8 product table
# to configs/plan/fp8/<preset>.json, the file the fp8 rule reads (commit it), and the job's later
# sections already choose their float8 linears by it. Traces, checkpoints and run folders stay in a
# scratch folder (SUITE_SCRATCH, default ${TMPDIR:-/tmp}/gpt3d-gpu-suite; checkpoints are deleted
# after each section), never in the results: only their tables are kept. Every section has a time
# limit and the run a deadline (SUITE_SECONDS, default 560 s, for a 10-minute job): a section that
# fails or runs out of time is recorded as such and the next one still runs. PYTHON picks the
# interpreter (default .venv/bin/python when present, else python3). No network is needed.
# Exit codes: 0 every section passed, 1 one failed or was skipped, 2 bad input or no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."

SECTIONS=(cuda-tests train-small step-65k profile train-large recovery-exact recovery-paths fp8-products shard
          fp8-large attention attention-sweep attention-band)
declare -A LIMIT=([cuda-tests]=140 [train-small]=180 [step-65k]=100 [profile]=90
                  [train-large]=420 [recovery-exact]=240 [recovery-paths]=240
                  [fp8-products]=120 [shard]=240 [fp8-large]=180 [attention]=170 [attention-sweep]=300
                  [attention-band]=200)
declare -A JOB=([cuda-tests]=1 [train-small]=1 [step-65k]=1 [profile]=1
                [train-large]=2 [recovery-exact]=3 [recovery-paths]=3
                [fp8-products]=4 [shard]=4 [fp8-large]=4 [attention]=5 [attention-sweep]=5 [attention-band]=6)
declare -A TITLE=(
  [cuda-tests]="CUDA tests: the kernel against float64, each kernel on its committed TABLE config"
  [attention]="Attention kernel vs SDPA's flash, cuDNN and efficient backends (T=2048 and 8192)"
  [train-small]="Training step of gpt3-125m and gpt3-350m: plain rows vs Hugging Face GPT-2, and the DeepSpeed engine by precision: autocast, bf16, fp8 tensorwise and rowwise, compiled bf16 and fp8 (MFU)"
  [step-65k]="Training step of gpt3-125m and gpt3-350m through the DeepSpeed engine, bf16, at 65,536 tokens a step (micro batch 32, as llm.c runs a GPU)"
  [profile]="Profile: where a step of gpt3-125m goes (python -m train's loop, bf16, micro batch 8)"
  [train-large]="Training step of gpt3-760m (micro batch 8) and gpt3-1.3b (micro batch 2), one model in memory at a time"
  [fp8-products]="float8 products vs bf16 by shape: each block linear's and head's _scaled_mm with its casts vs torch.mm, GPT-3's sizes; the table the fp8 rule reads"
  [shard]="One tensor-parallel rank's block vs the planner (gpt3-175b at tp=8, gpt3-13b at tp=2): bf16, fp8 tensorwise and rowwise, compiled"
  [fp8-large]="Training step of gpt3-1.3b (micro batch 2) through the DeepSpeed engine: bf16 and fp8, compiled, one engine at a time"
  [recovery-exact]="Recovery: kill -9 and SIGTERM, resumed bit for bit (gpt3-125m, seq 512, pinned kernel configs)"
  [recovery-paths]="Recovery: non-finite steps skipped, batch ramp, checkpoint GB/s, async vs sync pause (gpt3-125m, seq 512)"
  [attention-sweep]="Every attention block configuration the sm_90 compile keeps, per kernel and head dim, timed alone (JSON)"
  [attention-band]="GPT-3's banded layers (window 256): the kernel vs FlexAttention's sliding window (the baseline), flash-attn, SDPA"
)

bad() {  # bad MESSAGE: one line on stderr, exit code 2
  echo "gpu_suite: $*" >&2
  exit 2
}

valid_names() {
  local IFS=,
  echo "${SECTIONS[*]}" | sed 's/,/, /g'
}

list_sections() {
  local name job total
  printf '%-15s %7s %4s  %s\n' section limit job measures
  for name in "${SECTIONS[@]}"; do
    printf '%-15s %5s s %4s  %s\n' "$name" "${LIMIT[$name]}" "${JOB[$name]}" "${TITLE[$name]}"
  done
  for job in 1 2 3 4 5 6; do
    total=0
    for name in "${SECTIONS[@]}"; do
      if [ "${JOB[$name]}" = "$job" ]; then total=$((total + ${LIMIT[$name]})); fi
    done
    printf 'job %s: %s s of limits: bash bench/gpu_suite.sh --only %s\n' "$job" "$total" "$(job_sections "$job")"
  done
}

job_sections() {  # job_sections N: the job's sections, comma-separated
  local name out=""
  for name in "${SECTIONS[@]}"; do
    if [ "${JOB[$name]}" = "$1" ]; then out="${out:+$out,}$name"; fi
  done
  echo "$out"
}

section_command() {  # section_command NAME: sets CMD to the section's command, SHOW to it as a shell line
  local json="${RESULT%.md}-$1.json" shard175 shard13
  case "$1" in
    cuda-tests) CMD=(env GPT3D_TRITON_AUTOTUNE=0 "$PY" -m pytest -q -n 0 -p no:cacheprovider -rfEs --durations=5
                     tests/model/test_attention_cuda.py) ;;
    attention) CMD=("$PY" -m bench.attention --json "$json") ;;
    train-small) CMD=("$PY" -m bench.train_speed model=gpt3-125m model=gpt3-350m --json "$json") ;;
    step-65k) CMD=("$PY" -m bench.train_speed model=gpt3-125m model=gpt3-350m --micro-batch 32 --engine-only bf16
                   --json "$json") ;;
    profile) CMD=("$PY" -m bench.profile model=gpt3-125m train.micro_batch_size=8 train.global_batch_size=8
                  --run-dir "$SCRATCH/$STAMP-profile/run" --json "$json") ;;
    train-large) CMD=("$PY" -m bench.train_speed model=gpt3-760m model=gpt3-1.3b --json "$json") ;;
    fp8-products) CMD=("$PY" -m bench.fp8_products --budget-s $((LIMIT[fp8-products] - 25))) ;;
    fp8-large) CMD=("$PY" -m bench.train_speed model=gpt3-1.3b --fp8-pair --json "$json") ;;
    attention-sweep) CMD=("$PY" -m bench.attention_sweep --seconds 270 --json "$json") ;;
    attention-band) CMD=("$PY" -m bench.attention --banded --json "$json") ;;
    shard) shard175="$(printf '%q' "$PY") -m bench.shard model=gpt3-175b parallel.tp=8 train.micro_batch_size=1 train.precision=fp8"
           shard13="$(printf '%q' "$PY") -m bench.shard model=gpt3-13b parallel.tp=2 train.micro_batch_size=1 train.precision=fp8"
           CMD=(bash -c "$shard175 && $shard13")
           SHOW="$shard175 && $shard13"
           return ;;
    recovery-exact) CMD=("$PY" -m bench.recovery --device cuda --checks kill,sigterm --json "$json") ;;
    recovery-paths) CMD=("$PY" -m bench.recovery --device cuda --checks nonfinite,ramp,checkpoint --json "$json") ;;
  esac
  SHOW="${CMD[*]}"
}

run_section() {  # run_section NAME: run it for at most its limit (or what the deadline leaves), appending to RESULT
  local name="$1" limit="${LIMIT[$1]}" left=$((DEADLINE - SECONDS - 5)) start=$SECONDS rc=0 verdict
  local scratch="$SCRATCH/$STAMP-$name"
  section_command "$name"
  [ "$limit" -le "$left" ] || limit=$left
  printf '\n### %s: %s\n\n`%s` (time limit %s s)\n\n' "$name" "${TITLE[$name]}" "$SHOW" "$limit" >> "$RESULT"
  if [ "$limit" -lt 20 ]; then
    echo "SKIPPED: the deadline (SUITE_SECONDS=$SUITE_SECONDS) leaves ${limit} s" | tee -a "$RESULT" >&2
    FAILED=1
    return 0
  fi
  echo "== $name ($limit s): $SHOW" >&2
  mkdir -p "$scratch"
  echo '```' >> "$RESULT"
  # SIGINT first: pytest then prints the summary of the tests it finished; KILL 15 s later. Temporary
  # files (recovery's run folders) go to the section's scratch folder.
  TMPDIR="$scratch" timeout --signal=INT --kill-after=15 "$limit" "${CMD[@]}" 2>&1 | tee -a "$RESULT" \
    || rc=${PIPESTATUS[0]}
  echo '```' >> "$RESULT"
  # traces and logs stay, the GBs of checkpoints do not
  find "$scratch" -type d -name checkpoints -prune -exec rm -rf {} + || echo "gpu_suite: could not clear $scratch" >&2
  verdict="exit code $rc"
  if [ "$rc" -eq 124 ]; then verdict="TIMED OUT after $limit s (exit code 124)"; fi
  if [ "$rc" -ne 0 ]; then verdict="FAILED: $verdict"; FAILED=1; fi
  printf '\n%s, %s s\n' "$verdict" "$((SECONDS - start))" | tee -a "$RESULT" >&2
}

ARGS="$*"
ONLY="" ONLY_GIVEN=0 LIST=0 DRY_RUN=0 OUT_DIR=bench/results
while [ $# -gt 0 ]; do
  case "$1" in
    --list) LIST=1 ;;
    --only) [ $# -ge 2 ] || bad "--only takes section names, --only A,B; valid: $(valid_names)"
            ONLY="$2" ONLY_GIVEN=1; shift ;;
    --only=*) ONLY="${1#--only=}" ONLY_GIVEN=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) bad "unknown option '$1'; valid: --list, --only A,B, --dry-run, --help, and a results folder" ;;
    *) OUT_DIR="$1" ;;
  esac
  shift
done
if [ "$LIST" = 1 ]; then
  list_sections
  exit 0
fi
SELECTED=()
if [ "$ONLY_GIVEN" = 1 ]; then
  IFS=, read -r -a WANTED <<< "$ONLY"
  [ "${#WANTED[@]}" -gt 0 ] || bad "--only '$ONLY': no section named; valid: $(valid_names)"
  for name in "${WANTED[@]}"; do
    [ -n "$name" ] && [ -n "${LIMIT[$name]+set}" ] || bad "--only $ONLY: unknown section '$name'; valid: $(valid_names)"
    case " ${SELECTED[*]} " in *" $name "*) ;; *) SELECTED+=("$name") ;; esac
  done
else
  SELECTED=("${SECTIONS[@]}")
fi
SUITE_SECONDS="${SUITE_SECONDS:-560}"
[[ "$SUITE_SECONDS" =~ ^[0-9]+$ ]] || bad "SUITE_SECONDS=$SUITE_SECONDS: expected a number of seconds"
DEADLINE=$((SECONDS + SUITE_SECONDS))
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PY="$PYTHON"
SCRATCH="${SUITE_SCRATCH:-${TMPDIR:-/tmp}/gpt3d-gpu-suite}"
DAY="$(date -u +%F)"
STAMP="$(date -u +%Y%m%d-%H%M%S)"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

if [ "$DRY_RUN" = 1 ]; then
  RESULT="$OUT_DIR/<gpu>-$DAY.md"
  for name in "${SELECTED[@]}"; do
    section_command "$name"
    printf '%s (%s s): %s\n' "$name" "${LIMIT[$name]}" "$SHOW"
  done
  exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  bad "no CUDA device visible to $PY; nothing to measure"
fi
mkdir -p "$OUT_DIR" "$SCRATCH"
GPU="$("$PY" -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")"
RESULT="$OUT_DIR/$GPU-$DAY.md"
FAILED=0

{
  if [ ! -s "$RESULT" ]; then
    printf '# gpt3d GPU suite on %s, %s\n\nEach job below appended its sections as they ran.\n' "$GPU" "$DAY"
  fi
  commit="unknown (no git)"
  if head="$(git rev-parse --short HEAD 2>/dev/null)"; then
    commit="$head"
    git diff --quiet HEAD 2>/dev/null || commit="$head (with uncommitted changes)"
  fi
  printf '\n## Job at %s: %s\n\n' "$(date -u '+%H:%M UTC')" "$(IFS=,; echo "${SELECTED[*]}")"
  printf 'Command: `SUITE_SECONDS=%s bash bench/gpu_suite.sh %s` at commit %s\n\n' "$SUITE_SECONDS" "$ARGS" "$commit"
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 || true
  "$PY" - <<'EOF' 2>&1 || true
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version())
props = torch.cuda.get_device_properties(0)
print(f"{props.name}: {props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
for name in ("triton", "transformers", "deepspeed", "hydra", "datasets", "wandb", "torchao"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as err:  # report what is missing, measure the rest
        print(name, "unavailable:", type(err).__name__)
EOF
  echo '```'
} >> "$RESULT"

for name in "${SELECTED[@]}"; do
  run_section "$name"
done
echo "gpu_suite: results in $RESULT, scratch in $SCRATCH" >&2
exit "$FAILED"
