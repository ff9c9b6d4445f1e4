#!/bin/bash
# GPU checks, for a machine with CUDA GPUs (CI has none): the CUDA paths' tests
# (tests/gpu: weight buckets, rollout vs trainer log-probs, checkpoints, the default job on
# the GPU, NCCL with two GPUs), then scripts/gpu_check.py (vLLM on the GPU) if vLLM is
# installed. Exit 0 only if everything that ran passed; 2 without CUDA.
#
#     bash scripts/gpu_check.sh            (PYTHON=... to choose the interpreter)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" - <<'PYEOF' || exit 2
import torch
assert torch.cuda.is_available(), "gpu_check: no CUDA device: nothing run"
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} GPU(s): {names}")
PYEOF
rc=0
"$PY" -m pytest -m gpu tests/gpu -p no:cacheprovider -v -s -rs || rc=1
if "$PY" -c "import vllm" 2>/dev/null; then
    "$PY" scripts/gpu_check.py || rc=1
else
    echo "gpu_check: vLLM is not installed: scripts/gpu_check.py (vLLM on the GPU) not run"
fi
exit $rc
