"""Files and directories the tool writes: whole or not at all, and never through a path another
user of the machine controls.

- :func:`write_whole` (and :class:`WholeFile`, to stream): a file written atomically - to a new
  temporary file with an unpredictable name beside the target (``O_EXCL|O_NOFOLLOW``: nothing
  planted there is opened), renamed over the target (a rename replaces a symbolic link at the name,
  never follows it), removed when anything fails, so no reader ever sees half a file and a full
  disk leaves nothing behind.
- :func:`open_output` / :func:`open_output_fd`: every other file opened for writing (logs, records,
  spools): opened without following a link at its name and without blocking (a FIFO planted there
  cannot hold the caller), then checked on the open descriptor - a regular file, this user's, one
  link (a hard link to someone's file is refused) - and truncated only after that check.
  :func:`read_limited` reads a file back the same careful way, up to a bound.
- :func:`private_dir`: a directory the tool makes for itself - made new (mode 0700), or, when it is
  there already, checked as ssh and pytest check theirs: a directory, not a link, this user's,
  writable by no one else. :func:`make_dirs`: the missing part of a directory the user chose.
- :func:`unsafe_directory`: ssh's ``StrictModes`` for the directories that hold a path the user
  chose (a log directory, a trace file): each belongs to this user or root and is writable by no
  one else, unless it is sticky (``/tmp``) - group-writable is fine when the group is this user's
  own private group (Debian's usergroups), as Debian's OpenSSH allows.

What is refused raises :class:`UnsafePath` (a :class:`PermissionError`: code that survives a write
error survives it too), naming the path, what is wrong and the fix. Standard library only and cheap
to import (msrun's start path): :mod:`os`, :mod:`stat` and :mod:`errno`, which Python has loaded.
"""

from __future__ import annotations

import errno
import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any

_OUTPUT = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(PermissionError):
    """A path the tool will not write through: another user made it, or could replace it."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.EPERM, f"{path} {why}")
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)


def describe_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO")."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a plain file"


# ---------------------------------------------------------------- files
def write_whole(path: str, text: str | bytes, mode: int | None = None) -> None:
    """Write ``text`` (UTF-8 when a ``str``) to ``path`` atomically, with permissions ``mode``
    (default: as ``open`` makes a file, 0666 less the umask); an error is raised with nothing
    left behind."""
    with WholeFile(path, mode) as fh:
        fh.write(text.encode("utf-8") if isinstance(text, str) else text)


class WholeFile:
    """``with WholeFile(path) as fh: fh.write(...)``: ``path`` written whole or not at all - the
    bytes go to a new file beside it (see :func:`write_whole`), renamed over ``path`` when the
    block ends, or removed when it raises. An error writing names ``path``."""

    def __init__(self, path: str, mode: int | None = None) -> None:
        self.path = path
        self.mode = mode
        self.tmp = ""
        self.fh: IO[bytes] | None = None

    def __enter__(self) -> IO[bytes]:
        fd, self.tmp = _new_temp(self.path, 0o666 if self.mode is None else self.mode)
        try:
            if self.mode is not None:
                os.fchmod(fd, self.mode)  # exactly ``mode``, whatever the umask
            self.fh = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            self._discard()
            raise
        return self.fh

    def __exit__(self, etype: object, value: object, tb: object) -> None:
        assert self.fh is not None
        if etype is not None:  # what the block raised goes on, the file gone
            try:
                self.fh.close()
            except OSError:
                pass
            self._discard(value)
            return
        try:
            self.fh.close()
            os.replace(self.tmp, self.path)
        except BaseException as exc:
            self._discard(exc)
            raise

    def _discard(self, exc: object = None) -> None:
        """The temporary file removed; an :class:`OSError` that names no file (a write) names ``path``."""
        try:
            os.unlink(self.tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = self.path


def _new_temp(path: str, mode: int) -> tuple[int, str]:
    """A new file beside ``path`` under a name no one can guess (and so plant first)."""
    for _ in range(16):
        tmp = f"{path}.{os.urandom(6).hex()}.tmp"
        try:
            return os.open(tmp, _TEMP, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name beside it", path)


def open_output_fd(path: str, *, append: bool = False, mode: int = 0o666) -> int:
    """A descriptor (close-on-exec, blocking) for writing ``path``, created with ``mode`` (less the
    umask) or, when there, checked - a regular file of this user's with no other name - then
    truncated (unless ``append``). Raises :class:`UnsafePath` for anything else found there."""
    try:
        fd = os.open(path, _OUTPUT | (os.O_APPEND if append else 0), mode)
    except OSError as exc:
        _refuse_what_is_there(path, exc)
        raise
    try:
        _check_output(path, os.fstat(fd))
        if not append:
            os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_output(path: str, *, append: bool = False, binary: bool = False, buffering: int = -1) -> IO[Any]:
    """:func:`open_output_fd` as a file object (UTF-8 text, or ``binary``)."""
    fd = open_output_fd(path, append=append)
    try:
        how = ("a" if append else "w") + ("b" if binary else "")
        return os.fdopen(fd, how, buffering, None if binary else "utf-8")
    except BaseException:
        os.close(fd)
        raise


def _refuse_what_is_there(path: str, exc: OSError) -> None:
    """Raise :class:`UnsafePath` when ``exc`` came from what was found at ``path`` (a link, a FIFO
    no one reads, a device), so the error says that rather than "Too many levels of symbolic links"."""
    if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP, errno.ETXTBSY):
        return
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        try:
            _check_output(path, st)
        except UnsafePath as unsafe:
            raise unsafe from None


def _check_output(path: str, st: os.stat_result) -> None:
    """Raise :class:`UnsafePath` unless ``st`` (``path``'s) is a regular file of this user's with one name."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(path, "is a symbolic link, and nothing is written through one; remove it")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(path, f"is {describe_kind(st.st_mode)}, not a regular file; remove it")
    if st.st_uid != os.geteuid():
        raise UnsafePath(path, f"belongs to another user (uid {st.st_uid}); remove it, or write elsewhere")
    if st.st_nlink > 1:
        raise UnsafePath(path, f"has {st.st_nlink} names (hard links): writing it would change another file; remove it")


def planted(directory: str, ours: Callable[[str], bool]) -> str:
    """Why something at a name in ``directory`` that the tool writes (``ours(name)``) would be
    refused when written ("" when nothing is): a link, not a regular file, another user's, or a
    file with other names. Lets a launcher refuse before it starts anything, not halfway."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return ""
    for entry in entries:
        if not ours(entry.name):
            continue
        path = os.path.join(directory, entry.name)
        try:
            _check_output(path, os.lstat(path))
        except UnsafePath as exc:
            return str(exc)
        except OSError:
            continue
    return ""


def read_limited(path: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` (opened without following a link or blocking on a
    FIFO), None when it holds more than ``limit``; :class:`OSError` when it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(path, f"is {describe_kind(st.st_mode)}, not a regular file")
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                return data
            data += chunk
        return None
    finally:
        os.close(fd)


# ---------------------------------------------------------------- directories
def private_dir(path: str, *, tighten: bool = False) -> str:
    """``path`` as a directory of this user's that no one else can write: made now with mode 0700
    (and so are missing directories above it), or checked when it is there - a directory, not a
    link, this user's, writable by no one else (:class:`UnsafePath` otherwise). ``tighten``: also
    take group and other permissions away from one that is there (as pytest does with its
    ``pytest-of-<user>``) instead of refusing one others could write. Returns ``path``."""
    try:
        os.mkdir(path, 0o700)
        return path
    except FileExistsError:
        pass
    except FileNotFoundError:
        parent = os.path.dirname(path.rstrip("/"))
        if not parent or parent == path:
            raise
        private_dir(parent)
        return private_dir(path, tighten=tighten)  # made meanwhile (another rank): checked there
    try:
        fd = os.open(path, _DIR)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            st = os.lstat(path)
            raise UnsafePath(
                path, f"is {describe_kind(st.st_mode)}, not a directory; remove it (rm {path}) and try again"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafePath(
                path,
                f"belongs to another user (uid {st.st_uid}), who made it first; have it removed, or use another "
                "temporary directory",
            )
        if tighten and st.st_mode & 0o077:  # ours: as pytest does with its own
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o077)
        elif _others_can_write(st):
            raise UnsafePath(
                path,
                f"is writable by others (mode {stat.S_IMODE(st.st_mode):o}), who could have put anything in it; "
                f"remove it (rm -r {path}) and try again",
            )
    finally:
        os.close(fd)
    return path


def make_dirs(path: str) -> str:
    """``path`` and the missing directories above it, made with mode 0700 - for a directory the user
    chose (a log directory), whose safety :func:`unsafe_directory` checked where it was chosen; one
    that is there is used as it is, if it is this user's (another user may have made it meanwhile in
    a sticky directory such as ``/tmp``: :class:`UnsafePath`). Returns ``path``."""
    os.makedirs(path, 0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.geteuid() and st.st_uid != 0:
        raise UnsafePath(path, f"belongs to another user (uid {st.st_uid}), who made it first; use another directory")
    return path


def _others_can_write(st: os.stat_result) -> bool:
    """Whether someone other than this user (and root) may write the directory ``st`` describes."""
    if st.st_mode & stat.S_IWOTH:
        return True
    return bool(st.st_mode & stat.S_IWGRP) and not _private_group(st.st_gid)


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` has this user as its only member (primary or supplementary), as
    Debian's OpenSSH accepts a group-writable home under usergroups."""
    import grp
    import pwd

    try:
        group = grp.getgrgid(gid)
        me = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return False
    if any(member != me for member in group.gr_mem):
        return False
    primary = [user.pw_uid for user in pwd.getpwall() if user.pw_gid == gid]
    if any(uid != os.geteuid() for uid in primary):
        return False
    return bool(primary or group.gr_mem)


def unsafe_directory(path: str) -> str:
    """Why a directory that holds ``path`` lets someone else replace it ("" when none does): each
    directory above it - as written, and as the links in it resolve - must belong to this user or
    root and be writable by no one else, unless it is sticky (``/tmp``), where others cannot rename
    or remove what is ours; a link on the way must be this user's or root's. Directories that do not
    exist yet are made by this user: their existing ancestors are checked."""
    lexical = os.path.abspath(path)
    problem = _foreign_link(lexical)
    if problem:
        return problem
    return _chain_problem(os.path.dirname(os.path.realpath(lexical)))


def unsafe_output_dir(directory: str) -> str:
    """Why files written into ``directory`` could be replaced by someone else ("" when they cannot):
    :func:`unsafe_directory` for the directory itself and every one above it."""
    return unsafe_directory(os.path.join(directory, "_"))


def _foreign_link(path: str) -> str:
    """A symbolic link on ``path``'s way that another user owns (and so may point elsewhere)."""
    probe = path
    while True:
        try:
            st = os.lstat(probe)
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
            return (
                f"its path goes through {probe}, a symbolic link of another user's (uid {st.st_uid}), who could "
                "point it elsewhere; use a path of your own"
            )
        parent = os.path.dirname(probe)
        if parent == probe:
            return ""
        probe = parent


def _chain_problem(directory: str) -> str:
    """The first of ``directory`` and its ancestors that someone else may write ("" when none);
    those not made yet are skipped: they will be this user's (or cannot be made, which making
    them says)."""
    uid = os.geteuid()
    found = False
    while True:
        try:
            st: os.stat_result | None = os.stat(directory)
        except OSError as exc:
            if found:
                return f"its directory {directory} cannot be checked ({exc.strerror or exc})"
            st = None
        if st is not None:
            found = True
            if st.st_uid not in (0, uid):
                return (
                    f"its directory {directory} belongs to another user (uid {st.st_uid}), who could replace the "
                    "files in it; use a directory of your own"
                )
            if _others_can_write(st) and not st.st_mode & stat.S_ISVTX:
                return (
                    f"its directory {directory} is writable by others (mode {stat.S_IMODE(st.st_mode):o}), who "
                    f"could replace the files in it; use a directory only you can write (or run: chmod go-w "
                    f"{directory})"
                )
        parent = os.path.dirname(directory)
        if parent == directory:
            return ""
        directory = parent
