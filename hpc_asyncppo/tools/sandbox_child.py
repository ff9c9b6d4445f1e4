"""The sandbox's child process: ``python -I sandbox_child.py SPEC`` (``sandbox.py`` starts
it in the sandbox's empty directory, its stdout and stderr on files there, stdin closed,
the environment scrubbed). It locks itself in and then runs ``main.py``. Standard library
only: it imports nothing of the project.

In this order:
1. Hard rlimits that need no namespace: CPU seconds, address space, file size, no core.
2. A network and a PID namespace: no network (a loopback that is down), and every process
   of the sandbox dies with its first one. A user unshares them inside a new user
   namespace, where the node allows unprivileged ones; RLIMIT_NPROC set after it counts
   only the sandbox's own processes (the kernel counts them per user namespace), so the
   user's job does not use it up (without it, it counts every process of the user:
   ``SPEC["nproc"]`` then includes them). Root unshares them directly and then becomes
   nobody, without groups, keeping only CAP_DAC_READ_SEARCH where Landlock will confine
   reads (an interpreter under /root stays importable); RLIMIT_NPROC counts nobody's.
4. ``no_new_privs``, then Landlock (Linux >= 5.13, where enabled): reads and writes under
   the sandbox's directory, reads only in the interpreter's and the system's directories
   (not the run directory, not /proc, not a home).
5. Fork the namespace's PID 1, which dies with this process (PDEATHSIG) and forks the
   process that runs main.py; each waits for its child and exits with its status (128 +
   the signal that ended it).

``--probe`` instead prints which of 3 and 4 this node allows, as JSON.
"""

import ctypes
import json
import os
import resource
import runpy
import signal
import sys

NOBODY = 65534
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 1, 8, 38
CAP_DAC_READ_SEARCH = 2
SYS_LANDLOCK = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # all arches
LANDLOCK_RULE_PATH_BENEATH = 1
# Landlock's filesystem rights (linux/landlock.h): ABI 1 has bits 0-12, REFER is ABI 2,
# TRUNCATE ABI 3; the rights a rule on a regular file may hold
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ABI1 = (1 << 13) - 1
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14
READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR

libc = ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """Landlock's ABI version, 0 where the kernel has none (or it is disabled)."""
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(SYS_LANDLOCK["create_ruleset"], None, ctypes.c_size_t(0), 1)
    return max(0, int(version))


def isolate(keep_read: bool) -> bool:
    """Step 2; False where the namespaces cannot be had (the caller goes on without)."""
    if os.getuid() != 0:
        return libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) == 0
    entered = libc.unshare(CLONE_NEWNET | CLONE_NEWPID) == 0
    if keep_read:
        libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    if keep_read:
        set_capabilities(1 << CAP_DAC_READ_SEARCH)
    return entered


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def set_capabilities(caps: int) -> None:
    """Effective and permitted capabilities exactly ``caps`` (of the first 32), none inheritable."""
    header = CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (CapData * 2)(CapData(caps, caps, 0), CapData(0, 0, 0))
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def restrict_paths(abi: int, writable: str, readable: list[str], files: list[str]) -> None:
    """Landlock: everything under ``writable`` (its own directory), read (and execute)
    under ``readable``, read and write ``files`` (/dev/null); no other path at all."""
    handled = FS_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    attr = ctypes.c_uint64(handled)
    ruleset = libc.syscall(
        SYS_LANDLOCK["create_ruleset"], ctypes.byref(attr), ctypes.c_size_t(8), 0
    )
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    file_rights = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (FS_TRUNCATE if abi >= 3 else 0)
    rules = [(writable, handled)] + [(p, READ) for p in readable]
    rules += [(f, file_rights) for f in files]
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # absent on this node
        rule = PathBeneath(rights if os.path.isdir(path) else rights & file_rights, fd)
        done = libc.syscall(
            SYS_LANDLOCK["add_rule"], ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0
        )
        os.close(fd)
        if done < 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.syscall(SYS_LANDLOCK["restrict_self"], ruleset, 0) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)


def hard_limit(kind: int, value: int) -> None:
    resource.setrlimit(kind, (value, value))


def main(spec: dict) -> int:
    here = os.getcwd()
    # SIGXCPU at the soft limit, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    hard_limit(resource.RLIMIT_AS, spec["memory_mb"] << 20)
    hard_limit(resource.RLIMIT_FSIZE, spec["file_mb"] << 20)
    hard_limit(resource.RLIMIT_CORE, 0)
    if not isolate(keep_read=bool(spec["landlock"])) and spec["namespaces"]:
        print("sandbox: cannot enter its namespaces", file=sys.stderr)
        return 126
    hard_limit(resource.RLIMIT_NPROC, spec["nproc"])
    if spec["landlock"]:
        restrict_paths(spec["landlock"], here, spec["readable"], ["/dev/null"])
    return wait_for(fork(init))


def fork(child) -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(child())
    return pid


def wait_for(pid: int) -> int:
    """The exit code of child ``pid``: its own, or 128 + the signal that ended it."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def init() -> int:
    """PID 1 of the sandbox's namespace (where there is one): dies with the bootstrap, and
    runs the code in a child of its own, to which the kernel's limit signals (SIGXCPU,
    SIGXFSZ) are delivered as to any process (a namespace's PID 1 ignores them). When it
    ends, the kernel ends every other process of the namespace."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        return 137  # the bootstrap is gone already (outside a namespace)
    return wait_for(fork(run_code))


def run_code() -> int:
    sys.argv = ["main.py"]
    try:
        runpy.run_path("main.py", run_name="__main__")  # tracebacks say "main.py"
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - the code's error is its output
        import traceback

        # the traceback from the code's own frames on: none of the sandbox's
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        pid = os.fork()
        if pid == 0:  # namespaces tried in a child: this process stays where it is
            os._exit(0 if isolate(keep_read=False) else 1)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"namespaces": status == 0, "landlock": landlock_abi()}))
        sys.exit(0)
    sys.exit(main(json.loads(sys.argv[1])))
