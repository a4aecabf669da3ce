"""Which frameworks a fork server may hold: the rule a module's import must pass to be preloaded.

A template imports, before it forks a job's ranks, the frameworks the session's marked tests
import (torch, numpy, ...), so that a rank starts with them loaded. A fork stands for a fresh
interpreter only if the import would have left the same state in a rank - so a module is kept
only if its import, watched here:

* read none of a job's variables (:func:`job_var`: those msrun sets for a rank - ``RANK``,
  ``WORLD_SIZE``, ``MASTER_PORT``, ... - ``MS_*``, ``MSRUN_*``, ``*_VISIBLE_DEVICES``) and did not
  list the environment (a copy of it may hold them) - a rank's import reads its own values;
* opened no character device (a GPU's or NPU's: CUDA must not be initialised before a fork);
* left no thread running across a fork: a thread whose own fork handler stops it (OpenBLAS's pool,
  which numpy starts at import) is gone after one probe fork; any other would hold its locks
  in every rank.

And at each fork: a worker whose environment differs from the template's in a variable the
watched imports read (a marker's ``env``), or in the native thread pools' (:data:`NATIVE_PREFIXES`,
read from C as a library loads, out of the watch's reach), starts as a new process.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from pytest_msrun.engine import suppress

NATIVE_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTOBLAS_")
_JOB_PREFIXES = ("MS_", "MSRUN_")
_JOB_SUFFIX = "_VISIBLE_DEVICES"
LISTED = "*"  # a read of every variable (the environment listed or copied)


def job_var(name: str) -> bool:
    """Whether ``name`` may hold a value of one job or rank (a preloaded import must not read it)."""
    from pytest_msrun.engine.childenv import OWNED_VARS

    return name == LISTED or name in OWNED_VARS or name.startswith(_JOB_PREFIXES) or name.endswith(_JOB_SUFFIX)


class _Watched(type(os.environ)):  # type: ignore[misc]
    """``os.environ`` while an import is watched: every name looked up, and a listing, recorded."""

    reads: set[str] = set()

    def __getitem__(self, key):
        _Watched.reads.add(key if isinstance(key, str) else repr(key))
        return super().__getitem__(key)

    def __contains__(self, key):
        _Watched.reads.add(key if isinstance(key, str) else repr(key))
        return super().__contains__(key)

    def __iter__(self):
        _Watched.reads.add(LISTED)
        return super().__iter__()


def _devices() -> dict[int, str]:
    """This process's open character devices but ``/dev/null`` (descriptor: path)."""
    out = {}
    with suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with suppress(OSError, ValueError):
                st = os.stat(f"/proc/self/fd/{fd}")
                if stat.S_ISCHR(st.st_mode) and st.st_rdev != os.makedev(1, 3):
                    out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def single_threaded() -> bool:
    """Whether this process runs one thread - after a probe fork where it ran more: a thread whose
    library stops it in its fork handler (``pthread_atfork``: OpenBLAS's pool, which numpy starts
    at import) is gone then, and started again only when the library is used."""
    if threads() == 1:
        return True
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return threads() == 1


def load(name: str, modules: Iterable[str] = ()) -> tuple[str, set[str]]:
    """Import the package ``name``, then those of ``modules`` that are its own (``name.sub``, ...:
    what a session's collection imported, in that order), under watch: why it may not stay in a template ("" when
    it may) and the variables the imports read. A module of it that does not import is the ranks'
    own import (``ImportError``); any other failure refuses the package."""
    import importlib

    before = _devices()
    environ = os.environ
    plain = type(environ)
    _Watched.reads = set()
    environ.__class__ = _Watched
    try:
        for module in [name, *(m for m in modules if m != name and m.partition(".")[0] == name)]:
            try:
                importlib.import_module(module)
            except ImportError:
                if module == name:
                    raise
            except BaseException as exc:
                raise ImportError(f"{module}: {type(exc).__name__}: {exc}") from exc
    except BaseException as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, BaseException) else exc
        return f"its import failed ({type(cause).__name__}: {str(cause)[:200]})", set()
    finally:
        environ.__class__ = plain
    reads = set(_Watched.reads)
    job = sorted(n for n in reads if job_var(n))
    if job:
        what = "lists the environment" if LISTED in job else f"reads {', '.join(job[:3])}"
        return f"its import {what} (a rank's own values)", reads
    opened = [path for fd, path in _devices().items() if fd not in before]
    if opened:
        return f"its import opened a device ({opened[0]})", reads
    if not single_threaded():
        return "its import started a thread that a fork does not stop", reads
    return "", reads


def native_vars(env: Iterable[str]) -> list[str]:
    """The names in ``env`` that native libraries read as they load (:data:`NATIVE_PREFIXES`)."""
    return [n for n in env if n.startswith(NATIVE_PREFIXES)]


def _roots(paths: Iterable[str]) -> tuple[str, ...]:
    return tuple(os.path.join(os.path.realpath(p), "") for p in paths if p)


def installed_file(file: str, project: str) -> bool:
    """Whether the module file ``file`` is installed code: in site-packages, or elsewhere on the
    path but the standard library and the project's directory ``project``."""
    import site
    import sysconfig

    path = os.path.realpath(file)
    if path.startswith(_roots([*site.getsitepackages(), site.getusersitepackages()])):
        return True
    stdlib = [sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")]
    return not path.startswith(_roots([*stdlib, project]))


def script_imports(script: str, depth: int = 3) -> list[str]:
    """The installed modules ``script`` imports where it runs (its module level, not inside its
    functions), and those that the project's modules it imports from its directory import, in
    order (``import torch.distributed as dist``: ``torch``, ``torch.distributed``). Found by
    reading the files, importing nothing."""
    import ast
    import importlib.util

    project = os.path.dirname(os.path.realpath(script))
    out: list[str] = []
    seen: set[str] = set()

    def scan(path: str, level: int) -> None:
        try:
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), path)
        except (OSError, SyntaxError, ValueError):
            return
        todo: list[ast.AST] = list(tree.body)
        names: list[str] = []
        while todo:
            node = todo.pop(0)
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.append(node.module)
            elif isinstance(node, (ast.If, ast.Try)) or type(node).__name__ == "TryStar":
                for field in ("body", "orelse", "finalbody", "handlers"):
                    todo += [*getattr(node, field, [])]
            elif isinstance(node, ast.ExceptHandler):
                todo += node.body
        for name in names:
            if name in seen:
                continue
            seen.add(name)
            top = name.partition(".")[0]
            local = os.path.join(project, f"{top}.py")
            if os.path.isfile(local) or os.path.isdir(os.path.join(project, top)):
                if level < depth and os.path.isfile(local):
                    scan(local, level + 1)  # the project's own module: what it imports
                continue
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                continue
            origin = getattr(spec, "origin", None)  # ("frozen", "built-in": the interpreter's own)
            if (
                top != "pytest_msrun"
                and isinstance(origin, str)
                and os.path.isabs(origin)
                and installed_file(origin, project)
            ):
                out.extend(n for n in (top, name) if n not in out)

    scan(script, 0)
    return out
