"""Tools as a multi-turn rollout uses them: the hermes format read from model text, the tool
config built (and refused in one line), calls run beside the caller with a cap and a
timeout, and every way a tool can fail turned into an observation and a count."""

from __future__ import annotations

import threading
import time

import pytest

from hpc_asyncppo.tools.base import Tool, ToolConfigError, ToolResponse, load_tools
from hpc_asyncppo.tools.code_interpreter import CodeInterpreter
from hpc_asyncppo.tools.hermes import ToolCall, parse_tool_calls
from hpc_asyncppo.tools.runner import ToolRunner

SCHEMA = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}


def test_hermes_calls_are_read_and_garbage_becomes_error_messages():
    text = (
        'Let me look. <tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>\n'
        '<tool_call>{"name": "run", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "x", "arguments": 3}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("lookup", {"key": "a"}), ToolCall("run", {"code": "print(1)"})]
    assert len(parsed.errors) == 3 and all(e.startswith("error:") for e in parsed.errors)
    assert parse_tool_calls("no call here").calls == []


def write_config(tmp_path, body: str):
    path = tmp_path / "tools.yaml"
    path.write_text(body)
    return path


def test_the_tool_config_builds_verls_format(tmp_path):
    path = write_config(
        tmp_path,
        "tools:\n"
        "  - class_name: hpc_asyncppo.tools.code_interpreter.CodeInterpreter\n"
        "    config: {wall_s: 3, output_chars: 200}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function: {name: code_interpreter, parameters: {type: object}}\n",
    )
    tools = load_tools(path)
    assert list(tools) == ["code_interpreter"]
    assert tools["code_interpreter"].limits.wall_s == 3


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("tools: []\n", "needs a non-empty list 'tools'"),
        ("tools:\n  - class_name: no.such.Module\n    tool_schema: {function: {name: a}}\n",
         "cannot import class_name 'no.such.Module'"),
        ("tools:\n  - class_name: collections.OrderedDict\n    tool_schema: {function: {name: a}}\n",
         "is not a subclass of hpc_asyncppo.tools.base.Tool"),
        ("tools:\n  - class_name: hpc_asyncppo.tools.code_interpreter.CodeInterpreter\n",
         "needs tool_schema.function.name"),
        ("tools:\n  - class_name: hpc_asyncppo.tools.code_interpreter.CodeInterpreter\n"
         "    config: {wal_s: 3}\n    tool_schema: {function: {name: a}}\n",
         "refused its config (unknown keys ['wal_s']"),
        ("tools: [\n", "not valid YAML"),
    ],
)  # fmt: skip
def test_a_bad_tool_config_is_one_line_naming_the_entry(tmp_path, body, says):
    path = write_config(tmp_path, body)
    with pytest.raises(ToolConfigError) as caught:
        load_tools(path)
    message = str(caught.value)
    assert says in message and str(path) in message and "\n" not in message


class Probe(Tool):
    """Behaves as ``arguments["do"]`` says; counts the calls running at once."""

    def __init__(self, config=None, schema=SCHEMA):
        super().__init__(config or {}, schema)
        self.running = self.most = 0
        self.lock = threading.Lock()
        self.release_hang = threading.Event()

    def execute(self, instance_id, arguments):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            do = arguments["do"]
            if do == "raise":
                raise RuntimeError("boom")
            if do == "hang":
                self.release_hang.wait(60)
            if do == "garbage":
                return 42
            if do == "sleep":
                time.sleep(0.2)
            return ToolResponse(f"{instance_id}:{do}", reward=0.5)
        finally:
            with self.lock:
                self.running -= 1


def wait_all(pending, limit_s: float = 60.0):
    deadline = time.monotonic() + limit_s
    while not all(p.done() for p in pending):
        assert time.monotonic() < deadline, "a call never settled"
        time.sleep(0.01)
    return [p.observation for p in pending]


def test_failures_become_observations_and_counts_and_a_hang_costs_only_its_timeout():
    probe = Probe()
    runner = ToolRunner({"probe": probe}, max_parallel_calls=1, timeout_s=0.5)
    hang = runner.start("t0", ToolCall("probe", {"do": "hang"}))
    rest = [
        runner.start("t1", ToolCall("probe", {"do": "raise"})),
        runner.start("t2", ToolCall("probe", {"do": "garbage"})),
        runner.start("t3", ToolCall("nothing", {})),
        runner.start("t4", ToolCall("probe", {"do": "ok"})),
    ]
    observations = wait_all([hang, *rest])
    errors = [o.error for o in observations]
    assert errors == ["timeout", "raised", "garbage", "unknown_tool", None]
    assert "did not answer within 0.5 s" in observations[0].text
    assert "RuntimeError: boom" in observations[1].text and "probe" in observations[3].text
    # the one slot came back at the timeout: the calls after the hang all ran
    assert observations[4].text == "t4:ok" and observations[4].reward == 0.5
    assert runner.counts == {"calls": 5, "timeout": 1, "raised": 1, "garbage": 1, "unknown_tool": 1}
    probe.release_hang.set()


def test_calls_run_beside_the_caller_at_most_max_parallel_calls_at_once():
    probe = Probe()
    runner = ToolRunner({"probe": probe}, max_parallel_calls=2, timeout_s=30)
    pending = [runner.start(f"t{i}", ToolCall("probe", {"do": "sleep"})) for i in range(6)]
    assert not all(p.done() for p in pending)  # start returned before the calls ended
    assert [o.text for o in wait_all(pending)] == [f"t{i}:sleep" for i in range(6)]
    assert probe.most == 2


def test_the_code_interpreter_answers_with_the_programs_output():
    tool = CodeInterpreter({"wall_s": 5}, {"function": {"name": "code_interpreter"}})
    assert tool.execute("t", {"code": "print(sum(range(10)))"}).text == "45"
    failed = tool.execute("t", {"code": "1/0"}).text
    assert "ZeroDivisionError" in failed and "sandbox" not in failed
    assert "needs a string argument 'code'" in tool.execute("t", {"program": 1}).text
