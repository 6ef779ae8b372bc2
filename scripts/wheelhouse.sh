#!/usr/bin/env bash
# Builds, on a machine with the network, a folder of every wheel gpt3d needs that an offline target
# lacks, for the target's Python and platform; `bash scripts/setup.sh --offline DIR` installs from it.
#
#   bash scripts/wheelhouse.sh                                # CPython 3.12, manylinux_2_28_x86_64
#   bash scripts/wheelhouse.sh --have node-freeze.txt         # skip exactly what `pip freeze` on the node lists
#   bash scripts/wheelhouse.sh --native                       # this machine's Python and platform
#   bash scripts/wheelhouse.sh --interpreter python3.12       # markers evaluated by a 3.12 (when PATH has none)
#
# The folder (wheelhouse/<cpXY>-<platform> by default, git-ignored) ends with its size and list of
# packages; deepspeed is built from source with no op compiled ahead of time (DS_BUILD_OPS=0).
# PYTHON picks the Python that runs pip (default: .venv/bin/python when present, else python3); with
# --native it is also the target. Every option: bash scripts/wheelhouse.sh --help
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" scripts/wheelhouse.py "$@"
