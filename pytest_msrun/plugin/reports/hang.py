"""Hang diagnosis: who is stuck where, at one glance.

On a timeout every rank's Python stacks are dumped (faulthandler). Ranks are grouped by the
stack of their main thread, reduced to the frames that matter - the innermost frame of user
code and the collective it is in, then its callers up to the test harness::

    ranks 0-6 (7): barrier() at test_x.py:12 <- test_x() at test_x.py:30
    rank 7: compute() at model.py:40 <- test_x() at test_x.py:28

and the control plane adds what it knows: which ranks entered which collective, which never
joined, which had exited. No pytest import.
"""

from __future__ import annotations

import os
import re
import sysconfig
from typing import Any

import pytest_msrun
from pytest_msrun.cpulist import format_id_list

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_PACKAGE = os.path.dirname(os.path.abspath(pytest_msrun.__file__))
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"])
# Where a rank waits on its peers: these frames name the collective; user code calls them.
_COLLECTIVE_FILES = (
    os.path.join(_PACKAGE, "control", "cluster.py"),
    os.path.join(_PACKAGE, "cluster.py"),
    os.path.join(_PACKAGE, "plugin", "fixtures.py"),
)
_HARNESS = ("_pytest", "pluggy", os.sep + "pytest" + os.sep, "<frozen runpy>", os.sep + "runpy.py")
_SERVE = os.path.join(_PACKAGE, "plugin", "rank", "serve.py")
_LINKS = os.path.join(_PACKAGE, "plugin", "links.py")
# A rank of a warm world with no frame of the test's code, waiting for the controller in its serve
# loop (the world channel's receive(), called from serve.py): what it is doing, in words.
_IDLE = {
    "pytest_runtest_teardown": "finished the test's call; waits for the other ranks before its teardown",
    "pytest_runtestloop": "finished the test; waits in its warm world for the next one",
    # a forking world's template, its child for the test ended (it tore down without waiting)
    "_run_forked": "finished the test in a process of its own, which ended; waits for the other ranks",
}
_INTERNAL = (os.path.join(_PACKAGE, "control"), os.path.join(_PACKAGE, "plugin"))
MAX_CALLERS = 2

Frame = tuple[str, int, str]  # file, line, function


def threads(dump: str) -> dict[int, list[Frame]]:
    """Thread id -> frames (innermost first) from a faulthandler dump (the last dump wins)."""
    out: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in dump.splitlines():
        head = _THREAD.match(line)
        if head:
            current = []
            out[int(head.group(2), 16)] = current
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            current.append((frame.group(1), int(frame.group(2)), frame.group(3).strip()))
    return out


def main_stack(found: dict[int, list[Frame]], main_thread: int | None) -> list[Frame]:
    """The main thread's frames of a parsed dump (:func:`threads`); without its id, the thread
    that got the signal (listed last)."""
    if main_thread is not None and main_thread in found:
        return found[main_thread]
    return list(found.values())[-1] if found else []


def is_harness(path: str) -> bool:
    """A frame of pytest, pluggy or runpy: what runs the test, not the test."""
    return any(part in path for part in _HARNESS)


def is_msrun(path: str) -> bool:
    return os.path.abspath(path).startswith(_PACKAGE + os.sep)


def is_stdlib(path: str) -> bool:
    ap = os.path.abspath(path)
    return path.startswith("<frozen ") or (ap.startswith(_STDLIB) and "site-packages" not in ap)


def idle(frames: list[Frame]) -> str | None:
    """In words, what a rank idle in a warm world's serve loop is doing (None if it is not)."""
    for i, (path, _, func) in enumerate(frames):
        if os.path.abspath(path) == _LINKS and func == "receive":
            caller = frames[i + 1] if i + 1 < len(frames) else ("", 0, "")
            return _IDLE.get(caller[2]) if os.path.abspath(caller[0]) == _SERVE else None
    return None


def _is_internal(path: str) -> bool:
    if is_stdlib(path):  # frozen modules (posixpath, importlib, ...) included
        return True
    ap = os.path.abspath(path)
    return any(ap == p or ap.startswith(p + os.sep) for p in (*_COLLECTIVE_FILES, *_INTERNAL))


def _where(frame: Frame, name: str | None = None) -> str:
    path, line, func = frame
    return f"{name or func}() at {os.path.basename(path)}:{line}"


def signature(frames: list[Frame]) -> str:
    """``barrier() at test_x.py:12 <- test_x() at test_x.py:30``: where this stack is stuck."""
    api: str | None = None
    user: list[Frame] = []
    for frame in frames:
        path = frame[0]
        if is_harness(path):
            break
        if _is_internal(path):
            if not user and os.path.abspath(path) in _COLLECTIVE_FILES:
                api = frame[2]  # the outermost collective frame above user code wins
            continue
        user.append(frame)
    if not user:
        return idle(frames) or (_where(frames[0]) if frames else "no Python frame")
    parts = [_where(user[0], api)]
    if api is not None:
        parts.append(f"{user[0][2]}()")  # the function that called the collective
    parts += [_where(f) for f in user[1 : 1 + MAX_CALLERS]]
    return " <- ".join(parts)


def _ranks_label(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {format_id_list(ranks)} ({len(ranks)})"


def grouped(per_rank: dict[int, str]) -> dict[str, list[int]]:
    """The ranks of each distinct value, in the order of their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, value in sorted(per_rank.items()):
        groups.setdefault(value, []).append(rank)
    return groups


def group_lines(stacks: dict[int, list[Frame]], missing: dict[int, str]) -> list[str]:
    """One line per distinct stack, ranks grouped; ranks without a stack say why."""
    groups = grouped({rank: signature(frames) for rank, frames in stacks.items()})
    lines = [f"{_ranks_label(ranks)}: {sig}" for sig, ranks in groups.items()]
    return lines + [f"{_ranks_label(ranks)}: no stack ({why})" for why, ranks in grouped(missing).items()]


def state_lines(state: dict[str, Any] | None) -> list[str]:
    """What the control plane knew when the test timed out."""
    if state is None:
        return []
    world = int(state.get("world", 0))
    out: list[str] = []
    for coll in state.get("collectives", []):
        inside = [int(r) for r in coll.get("ranks", [])]
        waiting_for = [r for r in range(world) if r not in inside]
        op = {"gather": "all_gather", "bcast": "broadcast"}.get(coll.get("op"), coll.get("op"))
        out.append(
            f"{_ranks_label(inside)} entered {op} #{coll.get('seq')}; not there: "
            f"{format_id_list(waiting_for) if waiting_for else 'none'}"
        )
    joined = {int(r) for r in state.get("joined", [])}
    exited = {int(r): how for r, how in state.get("exited", {}).items()}
    never = [r for r in range(world) if r not in joined and r not in exited]
    if joined and never:
        out.append(f"never joined the group (cluster.init()): {format_id_list(never)}")
    elif not joined:
        out.append("no rank joined the group (cluster.init()): a hang outside the control plane's collectives")
    last = state.get("last", {})
    if joined and not never and not state.get("collectives") and not last:
        out.append("every rank joined the group, none entered a collective: a hang outside the control plane's")
    in_coll = {int(r) for c in state.get("collectives", []) for r in c.get("ranks", [])}
    outside = {int(r): what for r, what in last.items() if int(r) not in in_coll}
    out += [f"{_ranks_label(ranks)}: last collective {what}, none pending" for what, ranks in grouped(outside).items()]
    return out + [f"{_ranks_label(ranks)}: process {how}" for how, ranks in grouped(exited).items()]


def diagnosis(
    dumps: dict[int, str],
    main_threads: dict[int, int | None],
    ranks: list[int],
    state: dict[str, Any] | None,
    no_stack: dict[int, str],
) -> str:
    """The text shown on a timeout: grouped stacks, then the control plane's view."""
    stacks = {r: main_stack(threads(dumps[r]), main_threads.get(r)) for r in ranks if dumps.get(r, "").strip()}
    stacks = {r: f for r, f in stacks.items() if f}
    missing = {r: no_stack.get(r, "no dump") for r in ranks if r not in stacks}
    lines = ["where each rank was:"] + ["  " + line for line in group_lines(stacks, missing)]
    extra = state_lines(state)
    if extra:
        lines += ["control plane:"] + ["  " + line for line in extra]
    return "\n".join(lines)
