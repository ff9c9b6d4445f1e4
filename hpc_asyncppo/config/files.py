"""Where config files are found: a path as given, or a file in the package's ``configs/``
(the recipes, and the tool configs under ``configs/tools/``; installed with the package,
and at the repository's top as ``configs``, a link to them)."""

from __future__ import annotations

from pathlib import Path

from hpc_asyncppo.config.schema import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def tool_config_file(path: str) -> Path:
    """``rollout.multi_turn.tool_config_path`` as given, or a file in configs/ (the tool
    configs this repository ships: ``tools/lookup.yaml``, ``tools/code_interpreter.yaml``)."""
    for candidate in (Path(path), CONFIG_DIR / path):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(
        f"rollout.multi_turn.tool_config_path={path!r}: no such file (looked in . and {CONFIG_DIR})"
    )


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, or a name in configs/ (with or without .yaml)."""
    candidates = [Path(path), CONFIG_DIR / path, CONFIG_DIR / f"{path}.yaml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"config file {path!s} not found (looked in . and {CONFIG_DIR})")
