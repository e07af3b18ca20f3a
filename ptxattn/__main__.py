"""``python -m ptxattn [command] [options]``: with no command, the version, what this machine
runs (the doctor's summary) and the commands; otherwise the command."""

from __future__ import annotations

import sys

# command -> what it does; each is ptxattn/tools/<command>.py and takes --help
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
    if command == "doctor":
        from .tools import doctor
        return doctor.main(argv)
    if command == "kernels":
        from .tools import kernels
        return kernels.main(argv)
    if command == "tune":
        from .tools import tune
        return tune.main(argv)
    from .tools import profile
    return profile.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return run(argv[0], argv[1:])
    from . import __version__
    print(f"ptxattn {__version__}")
    if argv and argv[0] not in ("-h", "--help"):
        print(f"\nunknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from .tools import doctor
    print()
    doctor.summary()
    print()
    print(usage())
    return 0


if __name__ == "__main__":
    sys.exit(main())
