"""Running untrusted Python on a compute node, without Docker or root: the code
interpreter's sandbox (multi-turn tool use).

Each call runs in a process of its own (``sandbox_child.py``) in a new empty directory,
with a scrubbed environment (none of the job's variables: no Slurm, no tokens), stdin
closed, and hard limits: CPU seconds, address space, file size (its output files
included), processes; a wall-clock timeout kills its process group. Where the node
allows unprivileged user namespaces (or the job runs as root) it also gets no network and
its own PID namespace (all its processes die with it, however they detach), and where the
kernel has Landlock it can write only in its directory and read only there and in the
interpreter's and the system's directories. Run by root (CI, a container), the code runs
as nobody. What this node allows is probed once (``isolation()``) and said in one line
where something is missing. How each step is done: ``sandbox_child.py``.

What the caller gets (``Result``): stdout and stderr, each cut to ``Limits.output_chars``,
the exit code, the signal that ended the code (SIGXCPU: the CPU limit) or the wall
timeout. A write past the file size limit fails in the code (``OSError: File too large``:
Python ignores SIGXFSZ), its output's too. Memory of the caller: the output kept.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("sandbox_child.py")
NOBODY = 65534
SYSTEM_DIRS = ["/usr", "/lib", "/lib64", "/bin", "/etc"]


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # wall clock; then the process group is killed
    cpu_s: int = 5  # CPU seconds of each process (SIGXCPU)
    memory_mb: int = 1024  # address space of each process (a larger allocation fails)
    file_mb: int = 16  # any file it writes, its stdout and stderr included
    processes: int = 16  # processes and threads at once
    output_chars: int = 4096  # of stdout and of stderr, kept for the caller


@dataclass
class Result:
    stdout: str
    stderr: str
    exit_code: int  # 128 + the signal that ended it, or -1 after the wall timeout
    signal: str | None  # e.g. SIGXCPU (the CPU limit)
    timed_out: bool
    truncated: bool  # output beyond output_chars was cut
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@functools.cache
def isolation() -> dict:
    """What this node allows the sandbox: ``namespaces`` (unprivileged user, network and
    PID namespaces) and ``landlock`` (the kernel's Landlock ABI version, 0 if none); one
    warning line for what is missing."""
    out = subprocess.run(
        [sys.executable, "-I", str(CHILD), "--probe"],
        capture_output=True,
        text=True,
        timeout=30,
        env=scrubbed_environment(tempfile.gettempdir()),
        cwd=tempfile.gettempdir(),
    )
    found = json.loads(out.stdout) if out.returncode == 0 else {"namespaces": False, "landlock": 0}
    if not found["namespaces"]:
        log.warning(
            "sandbox: this node allows no %snetwork and PID namespaces: code keeps the "
            "network, and its processes are limited by %s RLIMIT_NPROC",
            "" if os.getuid() == 0 else "unprivileged user, ",
            "nobody's" if os.getuid() == 0 else "the user's",
        )
    if not found["landlock"]:
        log.warning(
            "sandbox: this kernel has no Landlock: code can read and write whatever %s can",
            "nobody" if os.getuid() == 0 else "this user",
        )
    return found


def scrubbed_environment(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }


def readable_dirs() -> list[str]:
    """The interpreter's directories and the system's: all the code may read besides its own."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return sorted(prefixes) + SYSTEM_DIRS


def own_processes() -> int:
    """Processes (tasks) of this user now: without a user namespace RLIMIT_NPROC counts them."""
    uid, count = os.getuid(), 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(entry / "task"))
            except OSError:
                continue
    return count


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run ``code`` (a Python program) in the sandbox; never raises for what the code does."""
    found = isolation()
    nproc = limits.processes + 2  # the sandbox's own two processes
    if not found["namespaces"] and os.getuid() != 0:
        nproc += own_processes()
    start = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix="hpc_asyncppo-sandbox-"))
    try:
        (home / "main.py").write_text(code)
        if os.getuid() == 0:
            for path in (home, home / "main.py"):
                os.chown(path, NOBODY, NOBODY)
        spec = {
            **asdict(limits),
            "nproc": nproc,
            "namespaces": found["namespaces"],
            "landlock": found["landlock"],
            "readable": readable_dirs(),
        }
        with open(home / ".stdout", "w+b") as out, open(home / ".stderr", "w+b") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", str(CHILD), json.dumps(spec)],
                cwd=home,
                env=scrubbed_environment(str(home)),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group, killed whole at the timeout
            )
            timed_out = False
            try:
                exit_code = proc.wait(limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                exit_code = -1
            stdout, cut_out = _head(out, limits.output_chars)
            stderr, cut_err = _head(err, limits.output_chars)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    sig = None
    if exit_code > 128 and exit_code - 128 in signal.Signals._value2member_map_:
        sig = signal.Signals(exit_code - 128).name
    return Result(
        stdout, stderr, exit_code, sig, timed_out, cut_out or cut_err, time.monotonic() - start
    )


def _head(file, chars: int) -> tuple[str, bool]:
    """The first ``chars`` characters of an output file, and whether there was more."""
    file.seek(0)
    raw = file.read(chars * 4 + 4)
    text = raw.decode("utf-8", errors="replace")
    more = len(text) > chars or bool(file.read(1))
    return text[:chars], more
