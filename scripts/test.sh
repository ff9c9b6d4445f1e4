#!/usr/bin/env bash
# The whole test suite, as CI runs it: install, lint, then pytest (MPI, Slurm and all).
# Tests that need the local Slurm cluster start it themselves (scripts/local_slurm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/install.sh --with-vllm  # CI runs the vLLM tests on its CPU build
$PYTHON -m ruff check .
$PYTHON -m ruff format --check .
set +e
$PYTHON -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  # pytest's "no tests collected": never a pass for this suite
  echo "test.sh: pytest collected no tests (wrong path or -k filter?)" >&2
  exit 1
fi
exit "$rc"
