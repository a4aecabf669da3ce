"""``pmsrun`` / ``python -m pytest_msrun``: start the job's guard before anything else.

The job's watchdog and cgroup come first (:mod:`pytest_msrun.engine.containment`, standard library
only): moving into a new cgroup waits for an RCU grace period, which then overlaps importing
and planning instead of delaying the first process. A quick look at the arguments decides
whether this is a launch at all (not ``--help`` or ``--print_plan``); when unsure it is, and the
guard is simply released on the way out.
"""

from __future__ import annotations

import os
import sys

# Options that take no value (the rest take one, as "--flag value" or "--flag=value").
_NO_VALUE = ("--print_plan", "--help")


def _launches(argv: list[str]) -> bool:
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-h":
            return False
        if not arg.startswith("-") or arg == "-":
            return True  # the task script: what follows is the task's
        name = arg.split("=", 1)[0]
        if len(name) > 2 and any(flag.startswith(name) for flag in _NO_VALUE):
            return False  # --print_plan or --help (argparse accepts unambiguous prefixes)
        i += 1 if "=" in arg else 2
    return False  # no task script: a usage error


def main(argv: list[str] | None = None) -> int:
    import gc

    # Start-up allocates module and class objects, none of them garbage: the cyclic collector
    # would only walk them (~5% of msrun's instructions before its first worker). The agent turns
    # it back on once the workers are started (``Agent._spawned``); at the latest, this does.
    collecting = gc.isenabled()
    gc.disable()
    from pytest_msrun.engine import timeline

    timeline.mark("msrun's first line")
    args = sys.argv[1:] if argv is None else argv
    guard = None
    job_id = os.urandom(8).hex()
    try:
        if _launches(args):
            from pytest_msrun.engine import heldsignals
            from pytest_msrun.engine.containment import JobGuard

            heldsignals.hold()  # until the event loop answers them (the watchdog and cgroup exist now)
            guard = JobGuard(job_id, dict(os.environ))
            timeline.mark("watchdog started, cgroup being entered")
        from pytest_msrun.engine.cli import main as cli_main

        timeline.mark("launcher imported")
        return cli_main(args, guard=guard, job_id=job_id)
    finally:
        timeline.mark("done")
        timeline.report()
        if collecting:
            gc.enable()


def run() -> None:
    """The ``pmsrun`` command: :func:`main`, then exit without tearing the interpreter down
    (msrun's work - the job, its files, its output - is complete when ``main`` returns)."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
