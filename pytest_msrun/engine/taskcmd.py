"""Turn ``task_script task_script_args...`` into a child argv, and find the task's interpreter."""

from __future__ import annotations

import os
import stat
import sys

from pytest_msrun.engine.config import COMMAND_TASKS, ConfigError
from pytest_msrun.pathsearch import which


def task_argv(script: str, args: list[str], python: str = sys.executable, *, must_exist: bool = True) -> list[str]:
    """The argv every worker runs.

    ``python``/``python3``/``pytest`` run as commands; a ``.py`` file runs with ``python``
    (this interpreter by default, not whatever ``python`` is first on PATH); an executable
    file or a command on PATH runs as itself; any other file runs with ``python``.
    """
    if script in COMMAND_TASKS:
        return [script, *args]
    if script.endswith(".py"):
        return [python, script, *args]
    if os.path.isfile(script):
        if os.access(script, os.X_OK):
            _check_interpreter(script)
            return [script if os.sep in script else os.path.join(".", script), *args]
        interpreter = shebang(script)
        if interpreter and not os.path.basename(interpreter[0]).startswith("python"):
            shown = " ".join(interpreter)
            raise ConfigError(
                "",
                f"task_script {script!r} starts with '#!{shown}' but is not executable, so msrun would run it "
                f"with Python; make it executable (chmod +x {script}) or name its interpreter "
                f"(msrun ... {interpreter[-1] if os.path.basename(interpreter[0]) == 'env' else interpreter[0]} "
                f"{script})",
            )
        return [python, script, *args]
    if which(script):
        return [script, *args]
    if not must_exist:  # --print_plan: show the command for a script that is not here
        return [python, script, *args]
    raise ConfigError("", f"task_script {script!r} is neither a file nor a command on PATH")


def shebang(path: str) -> list[str]:
    """The words of a file's ``#!`` line ([] when it has none)."""
    try:  # without blocking: a FIFO put where the script was must not hold msrun
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        first = os.read(fd, 512).split(b"\n", 1)[0] if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return []
    finally:
        os.close(fd)
    if not first.startswith(b"#!"):
        return []
    return first[2:].decode(errors="replace").split()


def _check_interpreter(script: str) -> None:
    """An executable script's ``#!`` interpreter must be there: else every worker's start fails
    (the kernel answers ``ENOENT`` for the script itself) - refused before anything starts."""
    words = shebang(script)
    if not words:
        return
    if os.path.basename(words[0]) == "env" and len(words) > 1 and not words[1].startswith("-"):
        if os.path.isfile(words[0]) and which(words[1]) is None:
            raise ConfigError(
                "",
                f"task_script {script!r} starts with '#!{' '.join(words)}' but {words[1]!r} is not on PATH; "
                "install it or fix the script's #! line",
            )
        return
    if which(words[0]) is None:
        raise ConfigError(
            "",
            f"task_script {script!r} starts with '#!{' '.join(words)}' but {words[0]!r} is not an executable file; "
            "install it or fix the script's #! line",
        )


def task_python(argv: list[str]) -> str:
    """The interpreter that will run the task (best effort; this one when unsure)."""
    head = argv[0]
    if head in ("python", "python3"):
        return which(head) or sys.executable
    if head == "pytest":
        found = which(head)
        words = shebang(found) if found else []
        if len(words) > 1 and os.path.basename(words[0]) == "env":
            return which(words[1]) or sys.executable
        return words[0] if words else sys.executable
    return sys.executable
