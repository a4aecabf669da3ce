"""A fork server: one interpreter that imported what a job runs, forking each job's msrun on request.

A new Python process spends most of its start on imports (pytest and every installed plugin:
~0.2-0.3 s), and a world's ranks are such processes. The template imports them once per session
and node, collects nothing and reads no job's variables, then waits on a socketpair. For each
request (an msrun command line, its environment, working directory and standard streams, passed as
descriptors) it forks a child with ``CLONE_PARENT``: the child is the *requester's* own child, as
if it had spawned it (its exit status, its signals, its parent-death signal), and runs msrun's entry
point. That msrun, a copy of the template, forks its Python workers (``python -m pytest ...``)
rather than starting interpreters (:func:`why_not_python` says when it may): they are msrun's own
children, in its session rules, its job's cgroup and its binding, exactly as spawned ones.

A fork stands for a fresh ``python`` only where start-up would have been the same: the same
interpreter, no interpreter options, and the same values of every variable start-up reads
(``PYTHON*``, the loader's, the locale's, ...; :data:`STARTUP_PREFIXES`). What may differ is only
msrun's rank hook on ``PYTHONPATH``: a forked worker runs that hook's steps itself. A template
whose imports started a thread, or whose installed code changed since it started, forks nothing.

The frameworks the session's marked tests import (torch, numpy, ...) are imported here too, once
the session asks (``{"frameworks": [...]}``), each only if its import passes
:mod:`~pytest_msrun.engine.preloadrule` - else the template starts over without it - so a rank
starts with them loaded; a fork then also needs the variables those imports read to be the same.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pytest_msrun.engine import preloadrule, suppress
from pytest_msrun.targets import resolve

FD_ENV = "MSRUN_TEMPLATE_FD"  # the template's end of its socketpair (a descriptor number)
HELLO_ENV = "MSRUN_TEMPLATE_HELLO"  # what the template imports, and how it started (JSON; a start over's too)
ENGINE_MODULES = (  # what msrun runs in a job: its launch path and the control plane it forks
    "pytest_msrun.engine.cli",
    "pytest_msrun.engine.agent",
    "pytest_msrun.engine.containment",
    "pytest_msrun.engine.earlystart",
    "pytest_msrun.engine.ranknotes",
    "pytest_msrun.control.scheduler",
    "json",
    "runpy",
)
# Variables an interpreter reads while it starts (or its C library does): a fork stands for a fresh
# interpreter only where each of them has the template's value.
STARTUP_PREFIXES = ("PYTHON", "LD_", "LC_", "MALLOC_", "GLIBC_", "COV_CORE_", "COVERAGE_")
STARTUP_NAMES = frozenset({"TZ", "LANG", "LANGUAGE", "HOME", "TMPDIR"})
REQUEST_LIMIT = 1 << 22  # bytes of one request (an environment and a command line)

# In the template and every process forked from it: its start-up environment (None elsewhere).
_origin: dict[str, str] | None = None
_stamp: dict[str, int] = {}  # files and directories whose change makes the template stale
_frameworks: list[str] = []  # the frameworks imported here (preloadrule's rule passed)
_framework_reads: set[str] = set()  # the variables their imports read


def is_template() -> bool:
    """Whether this process is the template or forked from it (msrun may fork its workers)."""
    return _origin is not None


def startup_vars(env: Mapping[str, str], hook_dir: str = "") -> dict[str, str]:
    """The variables of ``env`` an interpreter's start-up reads (``hook_dir``, msrun's rank hook,
    left out of ``PYTHONPATH``: a forked worker runs its steps itself)."""
    out = {k: v for k, v in env.items() if k in STARTUP_NAMES or k.startswith(STARTUP_PREFIXES)}
    if hook_dir and "PYTHONPATH" in out:
        parts = [p for p in out["PYTHONPATH"].split(os.pathsep) if p != hook_dir]
        if any(parts):
            out["PYTHONPATH"] = os.pathsep.join(parts)
        else:
            del out["PYTHONPATH"]
    return out


def differences(env: Mapping[str, str], origin: Mapping[str, str], hook_dir: str = "") -> list[str]:
    """The start-up variables whose values in ``env`` and ``origin`` differ (sorted names) - with
    frameworks preloaded, also those their imports read and the native libraries' (OMP_, ...)."""
    mine, theirs = startup_vars(env, hook_dir), startup_vars(origin)
    if _frameworks:
        names = _framework_reads | set(preloadrule.native_vars({*env, *origin}))
        mine.update({k: env[k] for k in names if k in env})
        theirs.update({k: origin[k] for k in names if k in origin})
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def hold(modules: list[str], env: Mapping[str, str]) -> str:
    """Make this process - an msrun not forked from a fork server - the template of its own Python
    workers: import ``modules`` (installed packages and their modules, in order) under the preload
    rule, then fork workers as a fork server's msrun does. Why not ("" when it holds them: a module
    refused leaves this process as it was, spawning its workers)."""
    global _origin, _stamp
    flags = sys.flags
    if _origin is not None or flags.isolated or flags.no_site or flags.ignore_environment or flags.dev_mode:
        return "this interpreter's options or state differ from a worker's"
    tops = list(dict.fromkeys(name.partition(".")[0] for name in modules))
    reads: set[str] = set()
    for top in tops:
        why, read = preloadrule.load(top, modules)
        if why:
            return f"{top}: {why}"
        reads |= read
    _frameworks[:] = tops
    _framework_reads.update(reads)
    _stamp = _take_stamp()
    _origin = dict(env)
    return ""


def frameworks() -> list[str]:
    """The frameworks this template (or the template this process was forked from) imported."""
    return list(_frameworks)


def why_not_python(argv: list[str], env: Mapping[str, str], hook_dir: str = "") -> str:
    """Why ``argv`` with ``env`` cannot run in a fork of this template ("" when it can): the fork
    must stand for ``python -m MODULE ...`` (or ``python SCRIPT ...``) started by this
    interpreter, with start-up reading the same variables, from unchanged installed code."""
    if _origin is None:
        return "msrun was not forked from a fork server"
    module = len(argv) >= 3 and argv[1] == "-m" and bool(argv[2]) and not argv[2].startswith("-")
    script = len(argv) >= 2 and not argv[1].startswith("-") and os.path.isfile(argv[1])
    if not (module or script):
        return "the command is not `python -m MODULE` or `python SCRIPT`"
    from pytest_msrun.pathsearch import which

    path = which(argv[0], path=env.get("PATH", os.defpath))
    if path is None or os.path.realpath(path) != os.path.realpath(sys.executable):
        return f"{argv[0]} is not the fork server's interpreter ({sys.executable})"
    differ = differences(env, _origin, hook_dir)
    if differ:
        return f"{', '.join(differ)} differ{'s' if len(differ) == 1 else ''} from the fork server's"
    return stale()


def binding_in_place(prefix: list[str]) -> tuple[list[int] | None, list[int] | None] | None:
    """The CPUs and the memory nodes (``MPOL_BIND``) a binding command in front would give its
    process, for a fork to set on itself - msrun's shapes only: ``taskset -c C``, ``numactl
    [--membind M] (--physcpubind C | --cpunodebind N)``, ``numactl --membind M``. ``--cpunodebind``
    is the nodes' CPUs within this process's, as libnuma computes it. None: not one of them."""
    from pytest_msrun.cpulist import RangeSyntaxError, parse_id_list

    name = os.path.basename(prefix[0]) if prefix else ""
    try:
        if name == "taskset" and len(prefix) == 3 and prefix[1] == "-c":
            return parse_id_list(prefix[2]), None
        if name != "numactl" or len(prefix) % 2 != 1:
            return None
        options = dict(zip(prefix[1::2], prefix[2::2]))
        if len(options) != len(prefix) // 2 or not set(options) <= {"--membind", "--physcpubind", "--cpunodebind"}:
            return None
        mems = parse_id_list(options["--membind"]) if "--membind" in options else None
        cpus = parse_id_list(options["--physcpubind"]) if "--physcpubind" in options else None
        if "--cpunodebind" in options:
            if cpus is not None:
                return None
            mine = os.sched_getaffinity(0)
            cpus = []
            for node in parse_id_list(options["--cpunodebind"]):
                with open(f"/sys/devices/system/node/node{node}/cpulist") as fh:
                    cpus += [c for c in parse_id_list(fh.read().strip()) if c in mine]
        return cpus, mems
    except (RangeSyntaxError, OSError, ValueError):
        return None


def stale() -> str:
    """Why the template's imports may no longer be the installed code ("" when they are)."""
    for path, mtime in _stamp.items():
        try:
            now = os.stat(path).st_mtime_ns
        except OSError:
            now = -1
        if now != mtime:
            return f"{path} changed since the fork server started"
    return ""


def _take_stamp() -> dict[str, int]:
    """What to watch: the file of every top-level module imported here (a package upgraded or
    reinstalled rewrites its ``__init__``). Files a job writes beside them change nothing."""
    out: dict[str, int] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) if "." not in name else None
        if isinstance(path, str):
            with suppress(OSError):
                out[path] = os.stat(path).st_mtime_ns
    return out


def rank_hook_dir() -> str:
    """msrun's rank hook directory, as msrun puts it on a worker's ``PYTHONPATH``."""
    from pytest_msrun.engine.errorfile import hook_dir

    return hook_dir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


_SHOWN: list[object] = []  # the buffers /proc/PID/cmdline and environ show (alive as long as this process)


def show_as(argv: list[str], env: Mapping[str, str]) -> bool:
    """Make ``/proc/PID/cmdline`` and ``/proc/PID/environ`` (what ``ps``, ``psutil`` and msrun's
    watchdog read) those of ``argv`` started with ``env``, as an ``exec`` would have set them
    (``prctl(PR_SET_MM_MAP)``: no privilege needed). Whether it could (False: they stay the
    template's - a kernel without checkpoint/restore, a seccomp filter)."""
    import ctypes

    class MemoryMap(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_uint64)
            for name in (
                "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
                "arg_start", "arg_end", "env_start", "env_end", "auxv",
            )
        ] + [("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]  # fmt: skip

    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        stat = {n: int(fields[n - 3]) for n in (26, 27, 28, 45, 46, 47)}  # proc(5)'s field numbers
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sbrk.restype = ctypes.c_void_p
        args = b"".join(os.fsencode(a) + b"\0" for a in argv)
        variables = b"".join(os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items())
        arg_buf = ctypes.create_string_buffer(args, len(args))
        env_buf = ctypes.create_string_buffer(variables, max(1, len(variables)))
        mm = MemoryMap(
            start_code=stat[26], end_code=stat[27], start_stack=stat[28], start_data=stat[45], end_data=stat[46],
            start_brk=stat[47], brk=libc.sbrk(0) or stat[47],
            arg_start=ctypes.addressof(arg_buf), arg_end=ctypes.addressof(arg_buf) + len(args),
            env_start=ctypes.addressof(env_buf), env_end=ctypes.addressof(env_buf) + len(variables),
            auxv=0, auxv_size=0, exe_fd=0xFFFFFFFF,
        )  # fmt: skip
        if libc.prctl(35, 14, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:  # PR_SET_MM, PR_SET_MM_MAP
            return False
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    _SHOWN[:] = [arg_buf, env_buf]
    return True


def shows_itself() -> bool:
    """Whether this process showed itself as the command it stands for (:func:`show_as`)."""
    return bool(_SHOWN)


def run_module(env: dict[str, str], argv: list[str]) -> int:
    """In a fork of the template (``fork_call``): run ``python -m MODULE ARGS`` (or ``python
    SCRIPT ARGS``) as a fresh interpreter would - ``sys.argv``, ``sys.path[0]``, ``__main__``,
    msrun's rank hook, an uncaught exception through ``sys.excepthook``, non-daemon threads joined
    and ``atexit`` handlers run at the end. Returns the exit status."""
    show_as(argv, env)
    hook = rank_hook_dir()
    if hook in env.get("PYTHONPATH", "").split(os.pathsep):
        _run_rank_hook(hook)
    module = argv[1] == "-m"
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.realpath(argv[1]))  # what python puts first
    sys.argv = ["-m", *argv[3:]] if module else argv[1:]  # (runpy puts the module's file first, as -m does)
    sys.orig_argv = list(argv)
    from pytest_msrun.engine.processes import exit_code_of, run_exit_steps

    code = 0
    try:
        import runpy

        if module:
            runpy._run_module_as_main(argv[2])  # type: ignore[attr-defined]
        else:
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as exc:
        code = exit_code_of(exc)
    except BaseException:
        code = 1
        with suppress(Exception):
            sys.excepthook(*sys.exc_info())
    run_exit_steps()
    return code


def _run_rank_hook(hook: str) -> None:
    """msrun's rank hook's steps, as ``site`` runs them in a spawned worker (no hold: a fork is
    made inside the job's cgroup; no chained ``sitecustomize``: the template ran it)."""
    import runpy

    steps = runpy.run_path(os.path.join(hook, "sitecustomize.py"), run_name="msrun_rankhook")
    for name in ("_install", "_trace_start", "_torch", "_leave"):
        with suppress(Exception):
            steps[name]()


# ------------------------------------------------------------------------------------ the template

_CLONE_PARENT = 0x00008000
_SIGCHLD = 17
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}  # clone(2) where its first argument is the flags


def clone_parent() -> int:
    """Fork this process as a child of its *parent* (``clone(CLONE_PARENT)``): 0 in the child,
    its pid here. Python's fork protocol around it (``PyOS_BeforeFork``/``AfterFork_*``: locks,
    the GIL, ``os.register_at_fork`` handlers such as :mod:`random`'s reseeding)."""
    import ctypes

    number = _SYS_CLONE.get(os.uname().machine)
    if number is None:
        raise OSError(f"clone(CLONE_PARENT) is not wired up on {os.uname().machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid = libc.syscall(ctypes.c_long(number), ctypes.c_ulong(_CLONE_PARENT | _SIGCHLD), 0, 0, 0, 0)
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    errno = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(errno, os.strerror(errno))
    return int(pid)


def _preload(hello: dict) -> list[str]:
    """Import the hello's ``preload`` modules, then msrun's own, then - inside pytest's
    assertion-rewriting hook (target ``rewriting-hook``: what ends it, or None where it cannot be
    made) - its ``plugins``, but ``skip``; returns those that failed, with why (a fork imports them
    again).

    A module whose import leaves a thread running across a fork cannot be in a template - a fork
    copies one thread and none of the locks the others hold: the template starts over without it
    (``exec`` of itself: the threads end), so that module is the ranks' own import. A thread its
    library stops at a fork (numpy's BLAS pool) is no such thread (:func:`preloadrule.single_threaded`)."""
    import importlib

    skip, failed = hello.get("skip", []), []

    def load(names: list[str]) -> None:
        for name in (n for n in names if n not in skip):
            try:
                importlib.import_module(name)
            except BaseException as exc:  # a plugin's import error is the rank's to report
                failed.append(f"{name}: {type(exc).__name__}")
            if not preloadrule.single_threaded():
                _start_over({**hello, "skip": [*skip, name]})

    load([*hello["preload"], *ENGINE_MODULES])
    # (a template forked from the session's process has its plugins imported: nothing to prepare)
    plugins = [n for n in hello["plugins"] if n not in sys.modules]
    done = resolve("rewriting-hook")() if plugins else None
    if done is not None:  # None: no such hook here, the ranks import the plugins themselves
        load(plugins)
        done()
    _load_frameworks(hello)
    return failed


def _start_over(hello: dict) -> None:
    """``exec`` this template anew with ``hello`` (the threads and imports of this one end)."""
    import json

    os.environ[HELLO_ENV] = json.dumps({**hello, "over": True})
    os.execv(sys.executable, [sys.executable, "-m", "pytest_msrun.engine.template"])


def _load_frameworks(hello: dict) -> None:
    """Import the hello's ``frameworks`` (but those refused before) under the preload rule; one
    refused: start over without it, its reason in ``hello["refused"]``."""
    refused = hello.setdefault("refused", {})
    modules = hello.get("modules", [])
    for name in hello.get("frameworks", []):
        if name in refused:
            continue
        why, reads = preloadrule.load(name, modules)
        if why:
            _start_over({**hello, "refused": {**refused, name: why}})
        if name not in _frameworks:
            _frameworks.append(name)
        _framework_reads.update(reads)


def _start_msrun(request: dict, fds: list[int], parent: int) -> int:
    """Fork ``python -m pytest_msrun ...`` for ``request`` (its ``cmdline``, environment and
    working directory; ``fds``: its stdin, stdout and stderr) as a child of ``parent``; returns
    its pid."""
    import signal

    from pytest_msrun.engine.processes import become_fresh_child, die_with_parent, forked

    def run() -> int:
        die_with_parent(signal.SIGTERM, parent)  # msrun tears its job down on SIGTERM, as spawned
        become_fresh_child(request["env"], stdin_fd=fds[0], stdout_fd=fds[1], stderr_fd=fds[2])
        os.chdir(request["cwd"])
        cmd = list(request["cmdline"])
        show_as(cmd, request["env"])
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.argv = [os.path.join(package, "__main__.py"), *cmd[3:]]  # as python -m sets it
        return resolve("msrun")(cmd[3:])

    return forked(run, clone_parent)


def _await_session(sock: object, hello: dict) -> bool:
    """In a template forked from the session's process before the session knew where its log
    goes (``hello["early"]``): wait for the session's first message, which carries that log as a
    descriptor (made this process's stdout and stderr). False: the session ended first."""
    import socket

    assert isinstance(sock, socket.socket)
    data, fds, _, _ = socket.recv_fds(sock, REQUEST_LIMIT, 1)
    for fd in fds:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    hello["early"] = "done"  # (a start over, see _preload, waits for nothing more)
    return bool(data)


def _ready(sock: object, hello: dict, failed: list[str]) -> str:
    """Say the template is ready (what it imported, and why a framework is not among them); why
    it forks nothing ("" when it forks)."""
    import gc
    import json

    global _stamp
    _stamp = _take_stamp()
    why = "" if preloadrule.single_threaded() else "an import started a thread (a fork copies only one)"
    gc.collect()
    gc.freeze()  # what the imports made stays shared with every fork (collections do not copy it)
    how = (
        "started over"
        if hello.get("over")
        else "forked from the session's process"
        if hello.get("early")
        else "started"
    )
    held = f"; frameworks: {', '.join(_frameworks)}" if _frameworks else ""
    print(f"fork server {os.getpid()}: {how}; {len(sys.modules)} modules imported{held}", flush=True)
    reply = {"ready": True, "why": why, "failed": failed, "n": hello.get("n", 0), "frameworks": _frameworks}
    sock.send(json.dumps({**reply, "refused": hello.get("refused", {})}).encode())  # type: ignore[attr-defined]
    return why


def serve(sock: object, parent: int) -> int:
    """The template's life, as ``parent``'s child that ends with it: the imports its hello names
    (:data:`HELLO_ENV`), then one msrun per request, until the requester closes its end."""
    import json
    import signal
    import socket

    from pytest_msrun.engine.processes import die_with_parent

    assert isinstance(sock, socket.socket)
    global _origin
    die_with_parent(signal.SIGKILL, parent)
    os.set_inheritable(sock.fileno(), True)  # kept across a start over (exec); never given to a fork
    hello = json.loads(os.environ.pop(HELLO_ENV))
    try:
        _origin = {k: v for k, v in os.environ.items() if k != FD_ENV}
        # "lazy": the session may have no job (its imports wait for its first); "eager": they start now
        if hello.get("early") == "lazy" and not _await_session(sock, hello):
            return 0
        failed = _preload(hello)
        del os.environ[FD_ENV]
        if hello.get("early") == "eager" and not _await_session(sock, hello):
            return 0
        why = _ready(sock, hello, failed)
        while True:  # (a signal does not interrupt a wait here: PEP 475)
            data, fds, _, _ = socket.recv_fds(sock, REQUEST_LIMIT, 3)
            if not data:
                return 0
            try:
                request = json.loads(data)
                if isinstance(request.get("frameworks"), list) and not fds:  # (replied as ready)
                    hello.update(frameworks=[str(n) for n in request["frameworks"]], n=request.get("n", 0))
                    hello["modules"] = [str(n) for n in request.get("modules", [])]
                    os.environ[FD_ENV] = str(sock.fileno())  # (a start over reads it)
                    _load_frameworks(hello)
                    del os.environ[FD_ENV]
                    why = _ready(sock, hello, failed)
                    continue
                problem = why or stale()
                if problem:
                    reply: dict = {"error": problem}
                elif len(fds) != 3:
                    reply = {"error": "a request carries stdin, stdout and stderr"}
                else:
                    reply = {"pid": _start_msrun(request, fds, parent)}
            except Exception as exc:  # this request's failure, not the template's end
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                for fd in fds:
                    with suppress(OSError):
                        os.close(fd)
            sock.send(json.dumps(reply).encode())
    except (ConnectionError, KeyboardInterrupt):
        return 0


def main() -> int:
    import socket

    parent = os.getppid()
    fd = os.environ.get(FD_ENV, "")
    if not fd.isdigit():
        print(f"{FD_ENV} is not set: this module is started by pytest-msrun's plugin", file=sys.stderr)
        return 2
    return serve(socket.socket(fileno=int(fd)), parent)


if __name__ == "__main__":  # run as the imported module, whose state msrun's forks read
    from pytest_msrun.engine import template

    code = template.main()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: a preloaded framework's takes ~0.2 s, and nothing here needs it
