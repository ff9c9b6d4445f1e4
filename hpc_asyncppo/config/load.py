"""A config from its layers: the dataclass defaults (``schema.py``), a YAML file, then
``key=value`` overrides (omegaconf dotted keys), validated once (``checks.py``). Unknown
keys and invalid values raise ``ConfigError`` with one line naming the key and what is
allowed (an unknown key: the valid ones); the CLI prints that line and exits non-zero
before any rank starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpc_asyncppo.config.checks import validate
from hpc_asyncppo.config.files import resolve_config_path
from hpc_asyncppo.config.schema import Config, ConfigError


def valid_keys(section: str = "") -> list[str]:
    """Dotted keys accepted under ``section`` ("" for the top level)."""
    node: Any = Config
    for part in [p for p in section.split(".") if p]:
        fields = {f.name: f for f in dataclasses.fields(node)}
        node = fields[part].default_factory  # type: ignore[assignment]
    return [f.name for f in dataclasses.fields(node)]


def _explain(exc: OmegaConfBaseException, where: str) -> str:
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0]
    if "Key '" in msg and "not in" in msg:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        try:
            keys = valid_keys(parent)
        except (KeyError, TypeError):
            keys = []
        return f"unknown config key '{key}' ({where}); valid keys{' under ' + repr(parent) if parent else ''}: {', '.join(keys)}"
    if key:
        return f"invalid value for config key '{key}' ({where}): {msg}"
    return f"invalid config ({where}): {msg}"


def _yaml_problem(exc: yaml.YAMLError, with_line: bool = True) -> str:
    """One line from a yaml error: its problem and where (line/column), without the excerpt."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if mark is None or not with_line:
        return problem
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    rollout_ranks: int = 1,
    train_ranks: int = 1,
) -> Config:
    """Defaults <- YAML at ``path`` <- ``key=value`` overrides, validated. Raises ConfigError."""
    schema = OmegaConf.structured(Config)
    layers = [schema]
    try:
        if path is not None:
            path = resolve_config_path(path)
            loaded = OmegaConf.load(path)
            if not isinstance(loaded, DictConfig):
                raise ConfigError(
                    f"config file {path} must be a YAML mapping of sections (model:, actor:, ...)"
                )
            layers.append(loaded)
        merged = OmegaConf.merge(*layers)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, f"in {path}")) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            merged.merge_with(OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise ConfigError(_explain(exc, f"override {item!r}")) from None
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({_yaml_problem(exc, with_line=False)}); "
                "close its brackets, or quote a text value: key='\"...\"'"
            ) from None
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    validate(cfg, rollout_ranks, train_ranks)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def load_resolved(path: str | Path) -> Config:
    """Load a run directory's config.yaml (already validated when the run was created)."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]
