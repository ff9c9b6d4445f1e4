"""The code interpreter's sandbox holds each of its limits against code written to break
it: an infinite loop, a sleep for ever, a fork bomb, a 10 GB
allocation, writing outside its directory, reading the job's environment, the network,
output without end. Real processes, real limits; nothing is mocked. Where this node lacks
a mechanism (``isolation()``), the tests that need it say so and skip."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from hpc_asyncppo.tools.sandbox import Limits, isolation, run_python

HANG_S = 60.0  # a wall-clock limit only a hang reaches, never a speed


def sandbox_processes() -> list[int]:
    """Processes still running the sandbox's child (any fork of it keeps its command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"sandbox_child.py" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def no_process_left() -> None:
    """No sandbox process is left (the suite runs the sandbox's tests one at a time:
    ``xdist_group`` in tests/conftest.py), once those being killed have gone."""
    deadline = time.monotonic() + HANG_S
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"a process of the sandbox outlived its call: {left}"


def test_output_exit_code_and_errors_come_back():
    ok = run_python("print(6 * 7)")
    assert ok.ok and ok.stdout == "42\n" and ok.stderr == ""
    assert run_python("raise SystemExit(3)").exit_code == 3
    failed = run_python("1 / 0")
    assert failed.exit_code == 1 and "ZeroDivisionError" in failed.stderr


def test_an_infinite_loop_ends_at_its_cpu_limit():
    # its wall limit a hang's: on a loaded core the loop still reaches its 1 s of CPU
    result = run_python("while True:\n    pass", Limits(wall_s=HANG_S, cpu_s=1))
    assert result.signal == "SIGXCPU" and not result.timed_out, result


def test_a_sleep_for_ever_costs_its_timeout_and_nothing_else():
    result = run_python("import time\ntime.sleep(10**6)", Limits(wall_s=1.0))
    assert result.timed_out and result.exit_code == -1
    assert result.seconds >= 1.0 and result.seconds < HANG_S  # its timeout; a hang's bound
    no_process_left()


def test_a_fork_bomb_is_held_to_its_process_limit_and_dies_with_the_call():
    counted = run_python(
        "import os, time\n"
        "n = 0\n"
        "for _ in range(1000):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(n)\n",
        Limits(processes=8),
    )
    assert counted.ok and 0 < int(counted.stdout) <= 8, counted
    no_process_left()  # the sleepers died with the call
    bomb = run_python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        Limits(wall_s=2.0, processes=8),
    )
    assert bomb.timed_out or bomb.signal == "SIGXCPU", bomb
    no_process_left()


def test_a_10_gb_allocation_fails_inside_the_sandbox():
    result = run_python("b = bytearray(10 * 2**30)\nprint(len(b))")
    assert result.exit_code == 1 and "MemoryError" in result.stderr, result


def test_a_write_past_the_file_size_limit_fails_and_tracebacks_show_only_the_code():
    result = run_python("open('big', 'wb').write(b'x' * (20 << 20))", Limits(file_mb=4))
    assert result.exit_code == 1 and "File too large" in result.stderr, result
    assert "sandbox" not in result.stderr and 'File "main.py", line 1' in result.stderr
    syntax = run_python("def broken(:")
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr


def test_output_is_cut_to_its_limit():
    result = run_python("print('x' * 100_000)", Limits(output_chars=1000))
    assert result.ok and result.truncated and len(result.stdout) == 1000


def test_it_writes_in_its_own_directory_only(tmp_path):
    if not isolation()["landlock"] and os.getuid() != 0:
        pytest.skip("no Landlock on this kernel: the code may write what the user may")
    inside = run_python("open('notes.txt', 'w').write('ok')\nprint(open('notes.txt').read())")
    assert inside.ok and inside.stdout == "ok\n", inside
    for target in (tmp_path / "escaped.txt", Path("/var/tmp") / f"escaped-{os.getpid()}"):
        result = run_python(f"open({str(target)!r}, 'w').write('x')")
        assert result.exit_code == 1 and "PermissionError" in result.stderr, result
        assert not target.exists()


def test_it_cannot_read_the_jobs_environment(monkeypatch):
    monkeypatch.setenv("HPC_ASYNCPPO_TEST_SECRET", "s3cret")
    result = run_python(
        "import os\n"
        "print(sorted(os.environ))\n"
        f"try:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
        "except OSError as exc:\n    print('denied', type(exc).__name__)\n"
    )
    assert result.ok and "s3cret" not in result.stdout and "SECRET" not in result.stdout
    assert "SLURM" not in result.stdout and "denied" in result.stdout, result


def test_it_has_no_network():
    if not isolation()["namespaces"]:
        pytest.skip("no network namespace for the sandbox on this node")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        )
    assert result.exit_code == 1 and "Network is unreachable" in result.stderr, result
