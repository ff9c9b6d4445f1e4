#!/bin/bash
# GPU check that fits one short lease (under 8 minutes on one GPU; no network, no vLLM, no
# Slurm needed): python -m hpc_asyncppo.gpu_check runs the CUDA paths, one line per check
# and a summary line (FSDP2 bf16 step, checkpoint from/to the GPU, the default job learning
# with both roles on one GPU, its weight sync through host memory, the GPU-binding function
# under a fake 8-GPU node, one PPO update of a Qwen2.5-7B-architecture model at the 7B
# recipe's token budget with its peak memory against memory.py's arithmetic, the memory
# check of the 7B recipe at this GPU's size, and the NCCL weight group's failures: a peer
# that never arrives, a member killed mid-sync (two GPUs), the in-flight sync's stream
# beside a busy training stream) and LoRA syncs merged on the GPU from a base read once.
# Then, only if vLLM is importable, scripts/gpu_check.py
# (vLLM on the GPU, fed through the weight group, each sync checked against the sender's
# digest and transformers' greedy log-probs). Exit 0 only if everything that ran passed;
# 2 (one line) without CUDA.
#
#     bash scripts/gpu_check.sh            (PYTHON=... to choose the interpreter)
#
# The GPU machine needs torch (CUDA), transformers, mpi4py + mpirun and h5py. This
# package's own code travels as the working tree; its pure-Python dependencies travel as
# wheels in the git-ignored folder .gpu_check_wheels/, made beforehand on a machine with
# network:
#     pip download --no-deps -d .gpu_check_wheels omegaconf antlr4-python3-runtime==4.9.3 \
#         submitit cloudpickle typing_extensions
# This script installs them with pip --no-index --target into .gpu_check_site/ (also
# git-ignored) and puts that and the working tree on PYTHONPATH; the ranks inherit it.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .gpu_check_wheels ] && ! [ -d .gpu_check_site ]; then
    "$PY" -m pip install -q --no-index --no-deps --target .gpu_check_site .gpu_check_wheels/*.whl \
        || { echo "gpu_check: cannot install .gpu_check_wheels/*.whl"; exit 1; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .gpu_check_site ] && PYTHONPATH="$PYTHONPATH:$PWD/.gpu_check_site"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 HF_HUB_OFFLINE=1
rc=0
"$PY" -m hpc_asyncppo.gpu_check "$@" || rc=$?
[ "$rc" = 2 ] && exit 2  # no CUDA: the one line is printed, nothing else runs
if "$PY" -c "import vllm" 2>/dev/null; then
    "$PY" scripts/gpu_check.py || rc=1
else
    echo "gpu_check: vLLM is not installed: scripts/gpu_check.py (vLLM on the GPU) not run"
fi
exit $rc
