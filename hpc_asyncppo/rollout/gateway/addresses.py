"""Where a run's gateways are, and the run's secret: files in RUN_DIR/gateway/, read by the
launcher, ``status`` and external agents without importing the gateway itself::

    RUN_DIR/gateway/token          the bearer token every request needs (mode 0600; made
                                   when the run directory is, kept across resumes)
    RUN_DIR/gateway/rank{i}.json   rollout rank i's address, once it listens
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from hpc_asyncppo.paths import GATEWAY

TOKEN = "token"


def token_path(run_dir: Path) -> Path:
    return run_dir / GATEWAY / TOKEN


def make_token(run_dir: Path) -> str:
    """The run's secret: created once (readable by its owner only), then read."""
    path = token_path(run_dir)
    path.parent.mkdir(exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(run_dir)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return read_token(run_dir)


def read_token(run_dir: Path) -> str:
    return token_path(run_dir).read_text().strip()


def address_path(run_dir: Path, rank: int) -> Path:
    return run_dir / GATEWAY / f"rank{rank}.json"


def read_addresses(run_dir: Path) -> list[dict[str, Any]]:
    """Every rollout rank's gateway address (``status`` shows them)."""
    rows = []
    for path in sorted((run_dir / GATEWAY).glob("rank*.json")):
        try:
            rows.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return rows
