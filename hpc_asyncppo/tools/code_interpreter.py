"""``code_interpreter``: the model writes a Python program, the tool runs it in the sandbox
(``sandbox.py``) and answers with its output. Stateless (every call a fresh process and
directory), so a call cut by a stop is safe to run again.

Config (all optional, ``sandbox.Limits``' fields): ``wall_s``, ``cpu_s``, ``memory_mb``,
``file_mb``, ``processes``, ``output_chars``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from hpc_asyncppo.tools.base import Tool, ToolResponse
from hpc_asyncppo.tools.sandbox import Limits, isolation, run_python


class CodeInterpreter(Tool):
    rerun_safe = True

    def __init__(self, config: dict[str, Any], schema: dict[str, Any]):
        super().__init__(config, schema)
        known = {f.name for f in fields(Limits)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown keys {unknown}; known: {sorted(known)}")
        self.limits = Limits(**config)
        isolation()  # probed once, at start-up: says what this node does not allow

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResponse("error: code_interpreter needs a string argument 'code'")
        result = run_python(code, self.limits)
        parts = [result.stdout.rstrip("\n")]
        if result.stderr:
            parts.append(result.stderr.rstrip("\n"))
        if result.timed_out:
            parts.append(f"error: the program ran past {self.limits.wall_s:g} s and was stopped")
        elif result.signal:
            parts.append(f"error: the program was ended by {result.signal}")
        if result.truncated:
            parts.append(f"(output cut to {self.limits.output_chars} characters)")
        text = "\n".join(p for p in parts if p)
        metrics = {"sandbox/seconds": result.seconds, "sandbox/failed": float(not result.ok)}
        return ToolResponse(text or "(no output)", metrics=metrics)
