"""What a tool is, and how a run names its tools (verl's tool config).

A tool is a Python class with a JSON schema (the function the model sees) and a config of
its own; one instance of it serves every trajectory of a rollout rank, each trajectory
having its own ``instance_id``: ``create`` when the trajectory starts, ``execute`` per
call, ``reward`` at its end (added to the task's reward), ``release`` after. Methods run
on worker threads beside generation (``runner.py``), so they may block; state they keep
per trajectory and want to survive a preemption goes through ``state`` /
``load_state`` (JSON values: no pickle), and ``rerun_safe`` says whether a call that was
running at a stop may be run again after the resume.

The tool config (``rollout.multi_turn.tool_config_path``) is verl's YAML::

    tools:
      - class_name: hpc_asyncppo.tools.code_interpreter.CodeInterpreter
        config: {wall_s: 10}
        tool_schema:
          type: function
          function:
            name: code_interpreter
            description: Run a Python program and see its output
            parameters: {type: object, properties: {code: {type: string}}, required: [code]}

``load_tools`` checks it and builds every tool; a mistake is one line (``ToolConfigError``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ToolConfigError(ValueError):
    """The tool config is wrong; the message is one line naming the file and the fix."""


@dataclass
class ToolResponse:
    text: str  # the observation the model reads
    reward: float = 0.0  # a reward this call earns the trajectory (summed)
    metrics: dict[str, float] = field(default_factory=dict)


class Tool:
    """Base class: subclasses override ``execute`` and whichever of the rest they need."""

    rerun_safe = True  # a call cut by a stop may run again after the resume

    def __init__(self, config: dict[str, Any], schema: dict[str, Any]):
        self.config, self.schema = config, schema

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def create(self, instance_id: str, **kwargs: Any) -> None:
        """A trajectory starts (``kwargs``: the prompt's ``tools_kwargs`` for this tool)."""

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        raise NotImplementedError

    def reward(self, instance_id: str) -> float:
        """The trajectory's reward from this tool, at its end."""
        return 0.0

    def release(self, instance_id: str) -> None:
        """The trajectory ended: free what ``create`` and ``execute`` kept for it."""

    def state(self, instance_id: str) -> dict[str, Any]:
        """What a checkpoint keeps of this trajectory's tool state (JSON values)."""
        return {}

    def load_state(self, instance_id: str, state: dict[str, Any]) -> None:
        """After a resume, instead of ``create``: the state ``state`` returned."""


def tool_schemas(path: str | Path) -> list[dict[str, Any]]:
    """The JSON schemas of the tools the config at ``path`` names (what the chat template
    shows the model), without building the tools."""
    return [tool.schema for tool in load_tools(path, build=False).values()]


def load_tools(path: str | Path, build: bool = True) -> dict[str, Tool]:
    """Every tool the config at ``path`` names, by its function name."""
    path = Path(path)
    where = f"tool config {path}"
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ToolConfigError(f"{where}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"{where}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), list) or not doc["tools"]:
        raise ToolConfigError(f"{where}: needs a non-empty list 'tools' (see tools/base.py)")
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(doc["tools"]):
        tool = _build(entry, f"{where}, tools[{i}]", build)
        if tool.name in tools:
            raise ToolConfigError(f"{where}: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def _build(entry: Any, where: str, build: bool = True) -> Tool:
    if not isinstance(entry, dict) or "class_name" not in entry:
        raise ToolConfigError(f"{where}: needs class_name (a Tool subclass's import path)")
    schema = entry.get("tool_schema")
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolConfigError(
            f"{where}: needs tool_schema.function.name (the name the model calls)"
        )
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: config must be a mapping")
    cls = _import(entry["class_name"], where)
    if not build:  # its schema only: the base class holds it
        return Tool(config, schema)
    try:
        return cls(config, schema)
    except (TypeError, ValueError, KeyError) as exc:
        raise ToolConfigError(
            f"{where}: {entry['class_name']} refused its config ({exc})"
        ) from None


def _import(name: str, where: str) -> type[Tool]:
    module, _, attr = name.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ToolConfigError(f"{where}: cannot import class_name {name!r} ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ToolConfigError(
            f"{where}: {name!r} is not a subclass of hpc_asyncppo.tools.base.Tool"
        )
    return cls
