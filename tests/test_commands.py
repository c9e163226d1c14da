"""The `defrag` console script (trainer/commands.py): it lists its commands, refuses an unknown one
in one line, and hands a command its arguments and exit status."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

from tests import DEFRAG
from trainer.commands import COMMANDS


def defrag(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DEFRAG, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_command_and_no_command_is_a_usage_error() -> None:
    listed = defrag("-h")
    assert listed.returncode == 0 and all(f"  {name} " in listed.stdout for name in COMMANDS)
    bare = defrag()
    assert bare.returncode == 2 and bare.stdout == "" and "usage: defrag COMMAND" in bare.stderr


def test_an_unknown_command_is_one_line_naming_the_commands() -> None:
    unknown = defrag("trian")
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == ("defrag: error: no command 'trian'; the commands: "
                                      + ", ".join(COMMANDS))


def side_by_side(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """`defrag` with each of these argument lists, all run at once (each imports for seconds)."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda argv: defrag(*argv), commands))


def test_a_command_gets_its_arguments_and_gives_its_exit_status() -> None:
    helped, wrong, missing = side_by_side(
        ["registry", "-h"], ["registry", "verify"], ["registry", "verify", "/nonexistent/model"])
    assert helped.returncode == 0 and helped.stdout.startswith("usage: defrag registry")
    # its folder argument missing: argparse's status 2
    assert wrong.returncode == 2 and "defrag registry verify: error:" in wrong.stderr
    assert missing.returncode == 1
    assert missing.stderr.startswith("defrag registry verify: error: ")
