"""``python -m ptxattn [command] [options]``: with no command (or --help), the version, what this
machine runs (the doctor's summary) and the commands; otherwise the command, each of which is
also ``python -m ptxattn.tools.<command>``."""

from __future__ import annotations

import importlib
import sys

from .tools.kernels import quiet_on_broken_pipe

# command -> what it does; each is ptxattn/tools/<command>.py, whose main(argv) takes --help
COMMANDS = {
    "doctor": "the driver, CUDA, NVRTC and GPUs this machine has, and what runs on them",
    "kernels": "compile every kernel variant for an architecture and check its budget",
    "tune": "measure the Hopper forward's tile schedules and write a tuning table",
    "profile": "attention throughput beside every peer importable here",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m ptxattn <command> [options]   (python -m ptxattn <command> "
             "--help)", "", "commands:"]
    lines += [f"  {name:{width}}  {what}" for name, what in COMMANDS.items()]
    return "\n".join(lines)


def run(command: str, argv: list[str]) -> int:
    """ptxattn/tools/<command>.py's main(argv): its exit status."""
    return importlib.import_module(f".tools.{command}", __package__).main(argv)


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return run(argv[0], argv[1:])
    if argv and argv[0] == "--version":
        from . import __version__
        print(f"ptxattn {__version__}")
        return 0
    if argv and argv[0] not in ("-h", "--help", "help"):
        what = "option" if argv[0].startswith("-") else "command"
        print(f"python -m ptxattn: unknown {what} {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from .tools import doctor
    doctor.summary()
    print("(details: python -m ptxattn doctor)\n")
    print(usage())
    return 0


if __name__ == "__main__":
    sys.exit(main())
