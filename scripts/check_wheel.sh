#!/usr/bin/env bash
# The package as a user gets it from a release: build its sdist and wheel, install the wheel
# into a fresh virtual environment (no system site-packages, no repository on the path) with
# only its declared dependencies, and run its command there: every subcommand's --help, a
# recipe found by name (--config), a two-step local run under mpirun, and that run's
# status, report, inspect, export and eval. scripts/test.sh runs it after pytest (CI).
#
# Needs the network or local mirrors for the dependencies (pip's cache makes re-runs
# quick; torch comes from the cached build scripts/install.sh used). KEEP=1 keeps the
# work folder (printed) for a look.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/var/tmp}/hpc_asyncppo-wheel.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then echo "check_wheel.sh: work folder $work"; else trap 'rm -rf "$work"' EXIT; fi
start=$(date +%s)
say() { echo "check_wheel.sh: $*"; }

$PYTHON -m build --sdist --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 || {
  cat "$work/build.log" >&2; say "building the sdist and wheel failed" >&2; exit 1; }
wheel=$(ls "$work"/dist/*.whl)
sdist=$(ls "$work"/dist/*.tar.gz)
# listed first: grep -q would end the listing early, which pipefail counts as a failure
wheel_files=$($PYTHON -m zipfile -l "$wheel")
sdist_files=$(tar -tzf "$sdist")
for member in hpc_asyncppo/configs/qwen2.5-7b-gsm8k.yaml hpc_asyncppo/configs/tools/lookup.yaml \
              hpc_asyncppo/tools/sandbox_child.py; do
  grep -q "^$member " <<<"$wheel_files" || { say "$wheel lacks $member" >&2; exit 1; }
  grep -q "/$member\$" <<<"$sdist_files" || { say "$sdist lacks $member" >&2; exit 1; }
done
say "built $(basename "$sdist") and $(basename "$wheel")"

$PYTHON -m venv "$work/venv"
venv="$work/venv/bin"
# torch pinned as install.sh pins it: an unpinned torch may pull a multi-GB CUDA build
pip_quietly() {
  "$venv/python" -m pip "$@" >>"$work/pip.log" 2>&1 || { cat "$work/pip.log" >&2; say "pip $* failed" >&2; exit 1; }
}
pip_quietly install "torch==$($PYTHON -c 'import torch; print(torch.__version__)')"
pip_quietly install "$wheel"
pip_quietly check
say "installed into a fresh virtual environment in $(( $(date +%s) - start )) s"

cd "$work"  # away from the repository: only the installed package can be imported
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
"$venv/python" -c "import hpc_asyncppo, sys; assert '$work/venv' in hpc_asyncppo.__file__, hpc_asyncppo.__file__"
for command in submit status report export inspect eval; do
  "$venv/hpc-asyncppo" "$command" --help >/dev/null
done
"$venv/python" -c "
from hpc_asyncppo.config.files import resolve_config_path, tool_config_file
for found in (resolve_config_path('qwen2.5-7b-gsm8k'), tool_config_file('tools/lookup.yaml')):
    assert '$work/venv' in str(found), found"
"$venv/python" -c "
from hpc_asyncppo.tasks.next_digit import held_out_prompts, write_prompts
from pathlib import Path
write_prompts(Path('val.jsonl'), held_out_prompts(8))"
"$venv/hpc-asyncppo" submit --cluster local --run-dir run trainer.total_steps=2 \
  actor.ppo_mini_batch_size=4 data.num_prompts=16 data.val=val.jsonl >submit.log 2>&1 || {
  cat submit.log >&2; say "the local run failed" >&2; exit 1; }
"$venv/hpc-asyncppo" status run >/dev/null
"$venv/hpc-asyncppo" report run >/dev/null
"$venv/hpc-asyncppo" inspect run >/dev/null
"$venv/hpc-asyncppo" export run hf >/dev/null
"$venv/hpc-asyncppo" eval run >eval.log
grep -q "8 prompts, n=1, greedy" eval.log || { cat eval.log >&2; exit 1; }
say "ok: the installed hpc-asyncppo trained, reported, exported and evaluated ($(( $(date +%s) - start )) s in all)"
