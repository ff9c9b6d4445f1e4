#!/usr/bin/env bash
# Install what hpc_asyncppo needs, idempotently: Open MPI (Debian packages, when run as
# root), a CPU build of torch unless some torch is already installed (on GPU clusters keep
# your CUDA build), then this package with its test tools. Re-runs are quick: pip is skipped
# while pyproject.toml is unchanged since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install.sh: installing Open MPI (openmpi-bin libopenmpi-dev)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  else
    echo "install.sh: Open MPI is missing: install openmpi-bin and libopenmpi-dev (or 'module load openmpi')" >&2
    exit 1
  fi
fi

stamp=build/.install-stamp
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $($PYTHON -c 'import sys; print(sys.executable)')"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && $PYTHON -c "import hpc_asyncppo, mpi4py, torch" 2>/dev/null; then
  exit 0
fi
if ! $PYTHON -c "import torch" 2>/dev/null; then
  # Pinned: an unpinned torch can pull a multi-GB CUDA build on a CPU machine.
  $PYTHON -m pip install -q "torch==2.13.0"
fi
$PYTHON -m pip install -q -e ".[test]"
mkdir -p build && echo "$want" > "$stamp"
