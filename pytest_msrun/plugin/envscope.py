"""Where a marked test's ``env`` applies: its job's processes (``job``, the default) or the test alone.

With ``--msrun-env-scope=test`` tests whose markers differ only in ``env`` share one world: its
ranks start without those variables and each test has its own set in ``os.environ`` for its
setup, call and teardown (a forked test: in its child). What would make that differ from a job
started with them is kept out of it:

* a variable a launcher, a framework or a native library reads at start-up or import
  (:data:`JOB_SCOPED_PREFIXES`: ``MSRUN_``, ``MS_``, ``OMP_``, ``CUDA_``, ...) stays the job's - a
  different value is another world;
* a variable the world's ranks read through ``os.environ`` or ``os.environb`` while they
  collected (a test module or conftest reading it at import) - the ranks report those reads -
  makes the test run as a fresh job with the variable set from the start. A wholesale read
  (``os.environ.copy()``, ``dict(os.environ)``, iterating it, ``len``) reads every variable, set
  or not: it counts as a read of each test's variables;
* fixtures broader than a test are torn down whenever the next test's variables differ, so no
  fixture set up under one test's values serves another's.

What stays different: native code of a module imported during collection that reads a variable
of another name with ``getenv`` at import sees the world's environment, not the test's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping

SCOPES = ("job", "test")
TRACK_ENV = "MSRUN_ENV_TRACK"  # in a world's ranks: the variables whose reads during collection count

JOB_SCOPED_PREFIXES = (
    "MSRUN_",  # this launcher
    "MS_",  # MindSpore and its msrun
    "GLOG_",
    "HCCL_",
    "ASCEND_",
    "CUDA_",
    "NCCL_",
    "TORCH",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "KMP_",
    "GOMP_",
    "PYTHON",
    "PYTEST_",
    "LD_",
    "MALLOC_",
    "RANK",
    "LOCAL_",
    "WORLD_SIZE",
    "MASTER_",
    "SLURM_",
    "HOME",
    "PATH",
    "TMP",
    "LANG",
    "LC_",
    "TZ",
)


def split(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``env`` as (the job's part, the test's part) under ``--msrun-env-scope=test``."""
    job = {k: v for k, v in env.items() if k.upper().startswith(JOB_SCOPED_PREFIXES)}
    return job, {k: v for k, v in env.items() if k not in job}


# ---------------------------------------------------------------- in a world's rank
_read: set[str] = set()
_watched: frozenset[str] = frozenset()


_wholesale_counts = [True]  # whether a wholesale read counts now (not while plugins configure)


def _wholesale() -> None:
    if _wholesale_counts[0]:
        _read.update(_watched)


def wholesale_reads(count: bool) -> None:
    """Whether wholesale reads count from now on: they do while conftests are imported and tests
    collected (a module may keep a copy), not while plugins configure themselves (pytest-benchmark
    copies the environment to run a command; no test's module sees that copy)."""
    _wholesale_counts[0] = count


class _Tracked(os._Environ):
    """``os.environ`` noting each look-up of a watched variable (``get``, ``in``, ``getenv`` and
    ``[]`` all come here), found or not - and a wholesale read (a copy, iteration) as a look-up
    of every watched variable."""

    def __getitem__(self, key: str) -> str:
        if key in _watched:
            _read.add(key)
        return super().__getitem__(key)

    def __iter__(self) -> Iterator[str]:  # keys(), items(), values(), dict(), copy() all iterate
        _wholesale()
        return super().__iter__()

    def __len__(self) -> int:
        _wholesale()
        return super().__len__()


class _TrackedBytes(_Tracked):
    """``os.environb``, tracked as :class:`_Tracked` (its keys are bytes)."""

    def __getitem__(self, key: bytes) -> bytes:  # type: ignore[override]
        if os.fsdecode(key) in _watched:
            _read.add(os.fsdecode(key))
        return super().__getitem__(key)  # type: ignore[index,return-value]


def track(watched: Iterable[str]) -> None:
    """From now until :func:`reads`: note which of ``watched`` this process looks up."""
    global _watched
    _watched = frozenset(watched)
    _read.clear()
    if _watched and type(os.environ) is os._Environ:
        os.environ.__class__ = _Tracked
    if _watched and type(os.environb) is os._Environ:
        os.environb.__class__ = _TrackedBytes


def reads() -> list[str]:
    """The watched variables looked up since :func:`track`; tracking ends."""
    if type(os.environ) is _Tracked:
        os.environ.__class__ = os._Environ  # type: ignore[assignment]
    if type(os.environb) is _TrackedBytes:
        os.environb.__class__ = os._Environ  # type: ignore[assignment]
    return sorted(_read)


def apply(env: Mapping[str, str]) -> dict[str, str | None]:
    """Set ``env`` in ``os.environ``; what it replaced (None: was not set), for :func:`revert`."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    return before


def revert(before: Mapping[str, str | None]) -> None:
    """Undo :func:`apply`."""
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
