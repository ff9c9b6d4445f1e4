"""An engine fault at the last step, with a validation due there: what the run logs.

Runs the default task on vLLM (CPU build) with one rollout rank and one trainer rank, a
validation of held-out prompts due at the last step only, and kills (SIGKILL, or SIGSTOP:
``--stop``) the rollout rank's engine core as soon as the last step's metrics row is
written: around the last weight sync, the validation's start and the final checkpoint.
Prints the run's exit code, the last step's validation row (or that there is none), the
rank's log lines about the restart and the validation, and the versions whose weights the
rank loaded after the fault (worker-side digests). What must hold: no validation row of
other weights than the last version's (a row means the rank validated that version's
weights, loaded again after its restart; none means the log says why).

    python scripts/check_final_sync_fault.py [--steps 12] [--stop] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpc_asyncppo.runlog import read_jsonl, split_metrics  # noqa: E402
from hpc_asyncppo.tasks import next_digit  # noqa: E402
from tests.conftest import vllm_environment  # noqa: E402
from tests.integration.test_vllm_runs import engine_core  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--stop", action="store_true", help="SIGSTOP the engine core, not SIGKILL")
    ap.add_argument("--keep", type=Path, help="the run's folder (default: a temporary one)")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="final-sync-fault-"))
    run_dir = root / "run"
    root.mkdir(parents=True, exist_ok=True)
    val = root / "val.jsonl"
    next_digit.write_prompts(val, next_digit.held_out_prompts(16))
    env = {**os.environ, **vllm_environment(root), "PYTHONUNBUFFERED": "1"}
    overrides = [
        "rollout.engine=vllm", "model.tiny.num_heads=2", "checkpoint.save_every=0",
        "trainer.record_weight_digests=true", "timeouts.sample_wait_s=120",
        f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.steps}",
        "trainer.val_before_train=false", f"data.val={val}", "rollout.engine_stall_s=5",
        "trainer.max_restarts=0",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local", "--run-dir",
           str(run_dir), "--rollout-ranks", "1", "--train-ranks", "1", *overrides]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 900
    while not any(r.get("step") == args.steps for r in read_jsonl(run_dir / "metrics.jsonl")):
        if proc.poll() is not None or time.monotonic() > deadline:
            print(proc.communicate()[0][-3000:])
            return 1
        time.sleep(0.01)
    core = engine_core(run_dir, 0)
    os.kill(core, signal.SIGSTOP if args.stop else signal.SIGKILL)
    loaded = len(read_jsonl(run_dir / "weights" / "rank0.jsonl"))
    out, _ = proc.communicate(timeout=900)
    print(f"exit code {proc.returncode}; {'SIGSTOP' if args.stop else 'SIGKILL'} of the engine "
          f"core (pid {core}) once step {args.steps}'s row was written")  # fmt: skip
    steps, vals = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))
    last = [v for v in vals if v["step"] == args.steps]
    print(f"last step: v{steps[-1]['param_version']}; its validation row: "
          + (str({k: v for k, v in last[0].items() if k.startswith('val/')}) if last else "none"))  # fmt: skip
    log = (run_dir / "logs" / "rank0.log").read_text().splitlines()
    for line in log:
        if any(w in line for w in ("restarting the engine", "void", "validated step",
                                   "new engine started", "weight group's generation")):  # fmt: skip
            print("rank0:", line[:220])
    for line in (run_dir / "logs" / "rank1.log").read_text().splitlines():
        if any(w in line for w in ("validation row", "go out again", "restart their engines")):
            print("rank1:", line[:220])
    digests = read_jsonl(run_dir / "weights" / "rank0.jsonl")
    print(f"versions rank 0 loaded: {[r['version'] for r in digests[:loaded]][-3:]} before the "
          f"fault, {[r['version'] for r in digests[loaded:]]} after")  # fmt: skip
    print(f"run folder: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
