"""Create a run directory from inside a batch job: what ``slurm/hetjob.sbatch`` calls.

``python -m hpc_asyncppo.launch.slurm.prepare RUN_DIR [--config FILE] [key=value ...]``
loads and checks the config for the job's actual rank counts (the sizes of het
components 0 and 1), then writes RUN_DIR/config.yaml (and the tiny model) as ``submit``
does. One line on stderr and exit 2 if the config is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hpc_asyncppo.config import ConfigError, load_config
from hpc_asyncppo.launch.rundir import RunDirError, prepare_run_dir
from hpc_asyncppo.memory import check_memory


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_asyncppo.launch.slurm.prepare")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--config", default=None, help="YAML config: a path or a name in configs/")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        rollout = int(os.environ.get("SLURM_NTASKS_HET_GROUP_0", "1"))
        train = int(os.environ.get("SLURM_NTASKS_HET_GROUP_1", "1"))
        cfg = load_config(args.config, args.overrides, rollout, train)
        check_memory(cfg, train)
        prepare_run_dir(cfg, args.run_dir)
    except (ConfigError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RunDirError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
