"""Tool calls beside generation: a rollout rank starts a call and goes on stepping its
engine; the call's observation is picked up when it is ready.

At most ``max_parallel_calls`` calls run at once on the rank (verl's name), each bounded
by ``timeout_s`` from the moment it starts running. A tool that raises, returns something
that is not a ``ToolResponse``, is called by a name no tool has, or runs past its timeout
gives the model an error message as its observation and is counted (``counts``); it never
ends the rank. A call past its timeout gives its slot back at once: its thread is left to
finish on its own (Python cannot stop a thread; the code interpreter's sandbox kills its
process itself at its own limit), so a tool that hangs for ever costs its timeout and one
idle thread, nothing else. Memory: one thread and the observation text per call in flight.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from hpc_asyncppo.tools.base import Tool, ToolResponse
from hpc_asyncppo.tools.hermes import ToolCall


@dataclass
class Observation:
    text: str
    reward: float = 0.0
    error: str | None = None  # None, "raised", "timeout", "garbage", "unknown_tool"
    seconds: float = 0.0  # from the call's start (its slot) to its observation


class PendingCall:
    """One call: ``done()`` never blocks; ``observation`` once it is."""

    def __init__(self, runner: ToolRunner, tool: Tool | None, instance_id: str, call: ToolCall):
        self.runner, self.tool, self.instance_id, self.call = runner, tool, instance_id, call
        self.started: float | None = None  # when it got a slot
        self.observation: Observation | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether the observation is ready; a call past its timeout is ended here."""
        with self._lock:
            started = self.started
            if self.observation is None and started is not None:
                if time.monotonic() - started > self.runner.timeout_s:
                    timeout = self.runner.timeout_s
                    self._settle(
                        Observation(
                            f"error: the tool {self.call.name!r} did not answer within {timeout:g} s",
                            error="timeout",
                        )
                    )
            return self.observation is not None

    def _run(self) -> None:
        self.runner.slots.acquire()
        with self._lock:
            self.started = time.monotonic()
        try:
            response = self.tool.execute(self.instance_id, self.call.arguments)
        except Exception as exc:  # noqa: BLE001 - the tool's error is the model's observation
            found = Observation(
                f"error: the tool {self.call.name!r} failed: {type(exc).__name__}: {exc}",
                error="raised",
            )
        else:
            if isinstance(response, ToolResponse) and isinstance(response.text, str):
                found = Observation(response.text, float(response.reward))
            else:
                found = Observation(
                    f"error: the tool {self.call.name!r} returned no text", error="garbage"
                )
        with self._lock:
            if self.observation is None:  # else: it timed out, and its slot is back already
                self._settle(found)

    def _settle(self, observation: Observation) -> None:
        """Under the lock: the call ends with ``observation`` and gives its slot back."""
        observation.seconds = time.monotonic() - (self.started or time.monotonic())
        self.observation = observation
        self.runner.settled(observation)
        if self.started is not None:
            self.runner.slots.release()


class ToolRunner:
    def __init__(self, tools: dict[str, Tool], max_parallel_calls: int, timeout_s: float):
        self.tools, self.timeout_s = tools, timeout_s
        self.slots = threading.BoundedSemaphore(max_parallel_calls)
        self.counts: Counter[str] = Counter()  # calls, and each error kind
        self.seconds = 0.0  # over every settled call
        self._count_lock = threading.Lock()

    def start(self, instance_id: str, call: ToolCall) -> PendingCall:
        """Start ``call`` for the trajectory ``instance_id`` (it waits for a slot on its thread)."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            text = f"error: there is no tool {call.name!r} (tools: {known})"
            return self.answered(instance_id, call, Observation(text, error="unknown_tool"))
        pending = PendingCall(self, tool, instance_id, call)
        threading.Thread(target=pending._run, daemon=True, name=f"tool-{call.name}").start()
        return pending

    def answered(self, instance_id: str, call: ToolCall, observation: Observation) -> PendingCall:
        """A call answered without running (no such tool, unreadable, not run again),
        counted as every call is."""
        pending = PendingCall(self, None, instance_id, call)
        with pending._lock:
            pending._settle(observation)
        return pending

    def settled(self, observation: Observation) -> None:
        with self._count_lock:
            self.counts["calls"] += 1
            if observation.error:
                self.counts[observation.error] += 1
            self.seconds += observation.seconds
