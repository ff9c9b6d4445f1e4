#!/usr/bin/env bash
# The whole test suite, as CI runs it: install, lint, then pytest (MPI, Slurm and all).
# Tests that need the local Slurm cluster start it themselves (scripts/local_slurm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
case "$PWD/" in
  /tmp/*)
    # The local Slurm cluster's emulated nodes each see a private /tmp (PMIx needs it):
    # code and run directories under /tmp are invisible to them. Run from a copy elsewhere.
    dest="/var/tmp/hpc_asyncppo-tests/$(echo "$PWD" | sha256sum | cut -c1-12)"
    echo "test.sh: $PWD is under /tmp, which the test cluster's nodes cannot see; running from $dest"
    rm -rf "$dest" && mkdir -p "$dest"
    tar -C "$PWD" --exclude=./runs -cf - . | tar -C "$dest" -xf -
    cd "$dest" && exec bash scripts/test.sh "$@"
    ;;
esac
bash scripts/install.sh --with-vllm  # CI runs the vLLM tests on its CPU build
# the agent harnesses (OpenAI Agents SDK, LangGraph, smolagents, ...) in an environment of
# their own, for tests/integration/test_harness_runs.py (about a minute and a half, once)
bash scripts/install_harnesses.sh
# verl's own code, for tests/trainer/test_verl_parity.py: the PyPI wheel, never installed
# (its imports need Ray and more); the test loads the math modules from the zip
verl_wheel=build/verl-reference/verl-0.7.1-py3-none-any.whl
if [ ! -f "$verl_wheel" ]; then
  $PYTHON -m pip download -q --no-deps "verl==0.7.1" -d build/verl-reference
fi
# This machine's speed varies with its neighbours (the same suite took 16 and 30 minutes on
# one day): a fixed Python loop timed here lets runs be compared.
$PYTHON -c 'import time; t = time.perf_counter(); sum(range(30_000_000)); print(f"test.sh: speed probe: 30M-term sum in {time.perf_counter() - t:.2f} s")'
$PYTHON -m ruff check .
$PYTHON -m ruff format --check .
# The suite starts about 300 Python processes of this code (launchers, ranks, spawned
# workers). Where PYTHONDONTWRITEBYTECODE is set (this machine and CI set it), none of them
# would cache its bytecode and each would compile what it imports again (0.1-0.15 s of CPU
# a rank): compiled once here, they read it. A stale file is recompiled on import, as usual.
$PYTHON -m compileall -q hpc_asyncppo tests scripts > /dev/null
set +e
# Two workers, each test module (and the Slurm tests together) on one of them: the runs
# leave a core idle while ranks start, wait on timeouts or sleep in Slurm's polls (see
# pytest_collection_modifyitems in tests/conftest.py). The slowest tests are listed at the
# end (pytest should stay under 15 minutes).
$PYTHON -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  # pytest's "no tests collected": never a pass for this suite
  echo "test.sh: pytest collected no tests (wrong path or -k filter?)" >&2
  exit 1
fi
if [ "$#" = 0 ]; then
  # the whole suite: also the package as a release installs it (about a minute and a half)
  bash scripts/check_wheel.sh || rc=1
fi
exit "$rc"
