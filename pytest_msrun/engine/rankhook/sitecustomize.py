"""msrun's rank hook: record this rank's uncaught exception in ``$MSRUN_ERROR_FILE`` as JSON.

msrun puts this directory first on a rank's ``PYTHONPATH``; Python's ``site`` imports this module
at start-up. A rank msrun started before it was inside the job's cgroup first waits here until
msrun moved it in (``$MSRUN_HOLD_FD``: see ``engine/earlystart.py``). Then it installs an
exception hook - and, once torch is imported, a rendezvous that waits for rank 0's store to listen
(and in a dry run, a peerless process group) - then removes every trace of itself (the directory
from ``PYTHONPATH`` and ``sys.path``, so processes the rank starts run without it) and runs the
``sitecustomize`` the rank would have had. Any error here is swallowed: it must never break a rank.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIMIT = 64 * 1024  # traceback characters kept (its end: where it failed)


def _write(path, pid, etype, value, tb):
    import json
    import time
    import traceback

    text = "".join(traceback.format_exception(etype, value, tb))
    if len(text) > _LIMIT:
        text = "...\n" + text[-_LIMIT:]
    module = getattr(etype, "__module__", "builtins")
    name = getattr(etype, "__qualname__", getattr(etype, "__name__", str(etype)))
    try:
        message = str(value)
    except Exception:  # a broken __str__
        message = f"<unprintable {name}>"
    record = {
        "type": name if module in ("builtins", "__main__") else f"{module}.{name}",
        "message": message[:_LIMIT],
        "traceback": text,
        "time": time.time(),
        "pid": pid,
    }
    # a new file under a name no one can guess, renamed over the record's (never through a link
    # someone put at either name); the package's fileio.write_whole, which this hook cannot import
    tmp = f"{path}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, path)
    except OSError:  # a full disk: no record, and no partial file left
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _hold():
    """Wait for msrun's byte on the inherited pipe; end-of-file: msrun is gone, so end too."""
    fd = os.environ.pop("MSRUN_HOLD_FD", "")
    if not fd.isdigit():
        return
    fd = int(fd)
    try:
        go = os.read(fd, 1)
    except OSError:  # not an open pipe: nothing holds this process
        return
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    if not go:
        os._exit(1)


def _install():
    path = os.environ.get("MSRUN_ERROR_FILE", "")
    pid = os.getpid()
    previous = sys.excepthook

    def hook(etype, value, tb):
        if path and os.getpid() == pid:  # not in a forked child
            try:
                _write(path, pid, etype, value, tb)
            except Exception:
                pass
        previous(etype, value, tb)

    sys.excepthook = hook


def _trace_start():
    """A traced job (``MSRUN_TRACE_SPOOL``): when this rank's Python ran its first line."""
    spool, rank = os.environ.get("MSRUN_TRACE_SPOOL", ""), os.environ.get("RANK_ID", "")
    if not (spool and rank.isdigit()):
        return
    import time

    # one JSON line (lane 1000 + rank: control/tracelog.RANK_PID, which this standard-library-only
    # hook cannot import), written without importing json (this runs before every rank's first line)
    pid, ts = 1000 + int(rank), int(time.time() * 1_000_000)
    line = f'{{"name":"python started","ph":"i","s":"t","pid":{pid},"tid":0,"ts":{ts}}}\n'
    # every rank of the node appends to one file (control/tracelog.RANKS_FILE): one write() of one
    # line with O_APPEND, which lands whole, after the others' lines. Opened as the package's
    # fileio.open_output_fd opens: not through a link, not blocking on a FIFO, and only a regular
    # file of this user's with one name.
    path = os.path.join(spool, "ranks.jsonl")
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    fd = os.open(path, flags, 0o600)
    try:
        st = os.fstat(fd)
        if not ((st.st_mode & 0o170000) == 0o100000 and st.st_uid == os.geteuid() and st.st_nlink == 1):
            raise OSError(f"{path} is not a regular file of this user's with one name")
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _torch():
    """Once torch is imported: a client rank's rendezvous waits for rank 0's store to listen
    (``pytest_msrun/control/torchstore.py``); a simulated rank's (``MS_SIMULATION_LEVEL``) process
    group and device meshes need no peers and no devices (``pytest_msrun/control/torchdry.py``)."""
    dry = bool(os.environ.get("MS_SIMULATION_LEVEL", "").strip())

    def install():
        try:
            from pytest_msrun.control import torchstore

            torchstore.install()
        except Exception:  # torch connects as it always did
            pass
        if not dry:
            return
        try:
            from pytest_msrun.control.torchdry import install

            install()
        except Exception as exc:  # said, not raised: the rank goes on (its init may then fail)
            sys.stderr.write(f"msrun: dry run: torch.distributed is not made peerless here: {exc!r}\n")

    if "torch" in sys.modules:  # a fork of a process that imported it
        install()
        return

    class AfterTorch:
        def find_spec(self, name, path=None, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = getattr(spec, "loader", None)
            if loader is not None and hasattr(loader, "exec_module"):
                run = loader.exec_module

                def exec_module(module):
                    run(module)
                    install()

                loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AfterTorch())


def _leave():
    parts = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if _HERE in parts:
        parts.remove(_HERE)
        if any(parts):
            os.environ["PYTHONPATH"] = os.pathsep.join(parts)
        else:
            os.environ.pop("PYTHONPATH", None)
    sys.path[:] = [p for p in sys.path if not (p and os.path.abspath(p) == _HERE)]


def _chain():
    """Import the next ``sitecustomize`` on the path, as site would have (its errors are site's)."""
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401  (the user's own; site reports errors)
    except ImportError as exc:
        if getattr(exc, "name", None) != "sitecustomize":
            raise
        if me is not None:
            sys.modules["sitecustomize"] = me


# Each step on its own: one that fails (the trace's disk is full) must not skip the next - above
# all _leave, without which _chain would import this file again, and again. (A worker msrun forks
# from its fork server runs the steps itself: engine/template.py.)
if __name__ == "sitecustomize":
    for _step in (_hold, _install, _trace_start, _torch, _leave):
        try:
            _step()
        except Exception:
            pass
    _chain()
