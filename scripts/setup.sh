#!/usr/bin/env bash
# Creates .venv (Python 3.11) with a CPU build of PyTorch and gpt3d installed editable with its test
# extras (torchao among them, for train.precision=fp8). Safe to re-run: an existing .venv with all of them is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
if [ -x .venv/bin/python ] && .venv/bin/python -c "import model, train, deepspeed, triton, torchao" 2>/dev/null; then
  exit 0
fi
"$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# CPU build of torch first (a GPU machine installs its own CUDA build instead); on hosts whose
# default index serves CUDA wheels, add: --index-url https://download.pytorch.org/whl/cpu
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
echo "gpt3d: environment ready in .venv"
