"""How long a vLLM engine's processes take to exit once asked (vLLM's CPU build).

    python scripts/probe_vllm_close.py

Starts a ``VLLMEngine`` on a tiny Llama (2 heads, vLLM's CPU attention needs head size 32),
sends its engine core SIGINT as ``VLLMEngine.close`` does, and prints the seconds until the
core (and with it its worker) has exited. Recorded in BENCHMARKS.md ("vLLM engine
shutdown"): before ``vllm_worker.skip_the_last_collection``, 9-10 s; after, ~3 s.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="probe-vllm-close-"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import vllm_environment

    os.environ.update(vllm_environment(root))
    import torch

    from hpc_asyncppo.config import DataConfig, ModelConfig, RolloutConfig, TinyModelConfig
    from hpc_asyncppo.models.tiny import build_tiny_model
    from hpc_asyncppo.rollout.vllm_engine import VLLMEngine
    from hpc_asyncppo.tasks import load_task

    words = load_task(DataConfig()).vocabulary()
    model = build_tiny_model(root / "model", words, TinyModelConfig(num_heads=2), seed=3)
    start = time.monotonic()
    engine = VLLMEngine(
        ModelConfig(path=str(model)),
        RolloutConfig(engine="vllm", n=8, response_length=16),
        torch.device("cpu"),
        max_prompt_length=32,
        seed=1,
    )
    print(f"engine started in {time.monotonic() - start:.1f} s", flush=True)
    procs = engine.engine_processes()
    asked = time.monotonic()
    for proc in procs:
        os.kill(proc.pid, signal.SIGINT)
    while any(p.is_alive() for p in procs) and time.monotonic() - asked < 60:
        time.sleep(0.05)
    print(f"engine core exit after SIGINT: {time.monotonic() - asked:.2f} s", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
