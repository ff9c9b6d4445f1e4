"""The command-line tool: ``hpc-asyncppo COMMAND [args]`` (a console script; also
``python -m hpc_asyncppo COMMAND``). Each command is one module's ``main``, which
``python -m hpc_asyncppo.<module>`` runs as well; ``hpc-asyncppo COMMAND --help`` shows
its flags. Only the chosen command's module is imported, so ``status`` stays quick."""

from __future__ import annotations

import importlib
import sys

# command -> (module, what it does)
COMMANDS = {
    "submit": ("hpc_asyncppo.submit", "start a run (local or Slurm), or --resume one"),
    "status": ("hpc_asyncppo.status", "where a run stands, on one screen"),
    "report": ("hpc_asyncppo.report", "a run's summary and RUN_DIR/report.png"),
    "export": ("hpc_asyncppo.export", "a checkpoint as a Hugging Face model folder"),
    "inspect": ("hpc_asyncppo.checkpoint.inspect", "what a checkpoint holds, checked"),
    "eval": ("hpc_asyncppo.eval", "score a checkpoint or a model folder on a data set"),
}
PROG = "hpc-asyncppo"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [args]   ({PROG} COMMAND --help for its flags)", ""]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from hpc_asyncppo import __version__

        print(f"{PROG} {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: {PROG}: unknown command {command!r}; one of: {', '.join(COMMANDS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest, prog=f"{PROG} {command}")


if __name__ == "__main__":
    sys.exit(main())
