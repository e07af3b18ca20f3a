"""`python -m ptxattn [command]`: the version, the doctor's summary and the commands; unknown
commands; every command also as `python -m ptxattn.tools.<command>`; a reader of the output that
goes away; and the profiler on a machine without a GPU (no GPU needed)."""

import subprocess
import sys
from pathlib import Path

import pytest

import ptxattn
from ptxattn import __main__ as cli
from ptxattn.tools import doctor, kernels, profile, tune
from test_doctor import driver  # noqa: F401  (a fixture: the NVIDIA driver stood in for)
from test_kernels import ClosedPipe

ROOT = Path(__file__).resolve().parents[1]


def _python_m(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args", [(), ("--help",)])
def test_no_command_prints_the_version_the_summary_and_the_commands(args):
    run = _python_m("ptxattn", *args)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"ptxattn {ptxattn.__version__} (Python ")
    assert lines[1].startswith(("NVIDIA driver", "GPU", "no GPU"))  # the doctor's summary
    assert "python -m ptxattn doctor" in run.stdout
    assert "usage: python -m ptxattn <command> [options]" in run.stdout
    for command, what in cli.COMMANDS.items():
        assert f"  {command:7}  {what}" in lines
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("argv", [[], ["-h"], ["help"]])
def test_no_command_in_process_shows_the_summary_without_a_driver(argv, driver, capsys):
    driver(None)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ptxattn {ptxattn.__version__} (Python ")
    assert "NVIDIA driver: no NVIDIA driver found" in out
    assert set(cli.COMMANDS) == {"doctor", "kernels", "tune", "profile"}
    assert all(f"  {command} " in out for command in cli.COMMANDS)


def test_version():
    run = _python_m("ptxattn", "--version")
    assert (run.returncode, run.stdout) == (0, f"ptxattn {ptxattn.__version__}\n")


@pytest.mark.parametrize("word, kind", [("bogus", "command"), ("--bogus", "option")])
def test_an_unknown_command_is_refused_with_the_usage(word, kind, capsys):
    assert cli.main([word, "--arch", "sm_90a"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"python -m ptxattn: unknown {kind} {word!r}")
    assert "usage: python -m ptxattn <command>" in err and "  kernels  " in err


def test_an_unknown_command_exits_2():
    run = _python_m("ptxattn", "kernel")
    assert run.returncode == 2
    assert "unknown command 'kernel'" in run.stderr and "usage:" in run.stderr


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_command_s_help_names_it_by_python_m_ptxattn(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m ptxattn {command} ")
    assert "python -m ptxattn." not in out  # the old module names


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_command_runs_as_python_m_ptxattn_tools_command(command):
    run = _python_m(f"ptxattn.tools.{command}", "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: python -m ptxattn {command} ")


def test_each_command_is_dispatched_to_its_module(monkeypatch):
    for command, module in (("doctor", doctor), ("kernels", kernels), ("tune", tune),
                            ("profile", profile)):
        monkeypatch.setattr(module, "main", lambda argv, name=command: (name, argv))
        assert cli.main([command, "--x", "1"]) == (command, ["--x", "1"])


# ---------------------------------------------------------------------------------------------
# A reader that goes away: each command stops quietly with the status of a SIGPIPE


@pytest.mark.parametrize("call", [
    lambda: cli.main([]),
    lambda: doctor.main([]),
    lambda: doctor.main(["--json"]),
    lambda: tune.main(["--dry-run", "--quick", "--head-dims", "64", "--no-fp8"]),
], ids=["ptxattn", "doctor", "doctor --json", "tune --dry-run"])
def test_a_closed_pipe_ends_each_command_quietly(call, driver, tmp_path, monkeypatch):
    driver(None)
    monkeypatch.setenv("PTXATTN_CACHE_DIR", str(tmp_path))  # tune's table: none read or written
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert call() == kernels.BROKEN_PIPE_STATUS


def test_doctor_piped_into_a_reader_that_stops_early_exits_quietly():
    with subprocess.Popen([sys.executable, "-m", "ptxattn", "doctor", "--json"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as run:
        run.stdout.close()  # before the doctor writes a line
        err = run.stderr.read().decode()
        status = run.wait(timeout=120)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert status == kernels.BROKEN_PIPE_STATUS, err


# ---------------------------------------------------------------------------------------------
# The profiler without a GPU


def test_the_profiler_without_a_driver_says_so_and_names_the_doctor(driver, capsys):
    driver(None)
    assert profile.main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "ptxattn profile: nothing to measure without a GPU: no NVIDIA driver found" in err
    assert "driver 580 or newer" in err  # check_driver's own words
    assert "python -m ptxattn doctor" in err


def test_the_profiler_with_a_driver_but_no_gpu_says_so(driver, monkeypatch, capsys):
    import cupy
    driver(13000)
    monkeypatch.setattr(cupy, "is_available", lambda: False)
    assert profile.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "CuPy sees no GPU" in err and "python -m ptxattn doctor" in err


def test_the_profiler_script_names_the_command():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile.py"), "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: python -m ptxattn profile ")
    assert "python scripts/profile.py [options]" in run.stdout
