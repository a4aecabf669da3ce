"""Two throwaway local accounts on this machine: a victim who runs msrun and the plugin, and an attacker.

Tests of the ``users`` tier prove that another local user gets nowhere: what the victim runs
(``pmsrun``, a plain ``pytest`` session) is started as the victim account, and every attack is a
process of the attacker account (scripts in ``tests/lab/attacker.py`` or written to its home),
never the test process with root rights - root only sets up and looks at the results.

    with UserLab() as lab:                                  # useradd x2, torn down after (verified)
        work = lab.victim.mkdir(lab.victim.home / "work")    # victim-owned, mode 0700
        lab.victim.run(["python", "-m", "pytest_msrun", ...], cwd=work, timeout=60)
        flood = lab.attacker.start(["python", ATTACKER, "flood", ...])
        lab.attacker.kill_all()

Accounts get unique names (``msrv<hex>`` the victim, ``msra<hex>`` the attacker), a user group of
their own and a home directory of mode 0700. Their commands run through ``setpriv`` (``runuser``
where it is missing) with a clean environment (HOME, USER, LOGNAME, PATH, LANG; no TMPDIR: the
temp directory is ``/tmp``; PYTHONPATH only where the tests themselves have one - the package
under test taken from another copy), optionally with a file-descriptor limit (``ulimit -n`` in a shell,
as a user sets it) and inside a netlab node (the node's ``nsenter`` prefix first, then the
change of user).

The interpreter must be reachable by an unprivileged user. Where a directory above it, its
``site-packages`` or the repository is closed to others (``/root`` with mode 0700 under pyenv),
the two accounts - and only they - are granted search (``x``) on that directory with a POSIX ACL
entry for each uid, written as the ``system.posix_acl_access`` attribute (no ``setfacl`` needed)
and removed at teardown.

:meth:`UserLab.down` kills every process of both accounts, deletes them with their homes, removes
every file either owns in ``/tmp``, ``/var/tmp`` and ``/dev/shm``, takes the ACL entries back, and
raises :class:`UserLeak` when anything of theirs is still there afterwards. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ATTACKER = Path(__file__).resolve().parent / "attacker.py"  # the attacker's tool box (run as the attacker)
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")  # where a user's files may be left: searched at teardown
COMMANDS = ("useradd", "userdel")


class UserLabError(RuntimeError):
    """The accounts could not be made or used."""


class UserLeak(UserLabError):
    """Teardown left a process or a file of an account behind (listed in the message)."""


def unusable_reason() -> str | None:
    """Why two throwaway accounts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a second local user needs root (useradd, setpriv)"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if shutil.which("setpriv") is None and shutil.which("runuser") is None:
        missing.append("setpriv (or runuser)")
    if missing:
        return f"missing command(s): {', '.join(missing)} (apt-get install passwd util-linux)"
    return None


@dataclass
class Result:
    """A finished command of an account."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _switch_prefix(name: str, uid: int, gid: int) -> list[str]:
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--"]
    return ["runuser", "-u", name, "--"]


@dataclass
class Account:
    """One throwaway local user."""

    name: str
    uid: int
    gid: int
    home: Path
    python: str = sys.executable  # an interpreter this account can run (see UserLab.grant_python)

    # ---------- commands ----------
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A clean login-like environment: nothing of the test process leaks into the account's."""
        path = os.pathsep.join([os.path.dirname(self.python), "/usr/local/bin", "/usr/bin", "/bin"])
        env = {
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "PATH": path,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",  # the repository and site-packages are root's
        }
        if os.environ.get("PYTHONPATH"):  # the package under test, where the tests take it from another copy
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env.update(extra or {})
        return env

    def command(self, argv: Sequence[str], *, nofile: int | None = None, prefix: Sequence[str] = ()) -> list[str]:
        """``argv`` as this account: ``prefix`` (root's, e.g. a netlab node's nsenter) first, then the
        descriptor limit (``ulimit -n``, soft and hard), then the change of user."""
        argv = [self.python if a == "python" else str(a) for a in argv]
        out = list(prefix)
        if nofile is not None:
            out += ["sh", "-c", 'ulimit -n "$0" && exec "$@"', str(nofile)]
        return [*out, *_switch_prefix(self.name, self.uid, self.gid), *argv]

    def start(
        self,
        argv: Sequence[str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        nofile: int | None = None,
        prefix: Sequence[str] = (),
        **popen: object,
    ) -> subprocess.Popen:
        """Start ``argv`` as this account (``python`` means :attr:`python`); its own session, so a
        stop reaches everything it started. Output is piped as text unless ``popen`` says otherwise."""
        popen.setdefault("stdin", subprocess.DEVNULL)
        popen.setdefault("stdout", subprocess.PIPE)
        popen.setdefault("stderr", subprocess.PIPE)
        popen.setdefault("start_new_session", True)
        if popen["stdout"] == subprocess.PIPE:
            popen.setdefault("text", True)
        return subprocess.Popen(  # type: ignore[call-overload]
            self.command(argv, nofile=nofile, prefix=prefix),
            cwd=str(cwd or self.home),
            env=self.env(env),
            **popen,
        )

    def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        nofile: int | None = None,
        prefix: Sequence[str] = (),
        timeout: float = 60.0,
        input: str | None = None,
    ) -> Result:
        """Run ``argv`` as this account to completion; killed (with everything it started) past
        ``timeout``, which fails the caller with what it printed."""
        proc = self.start(
            argv,
            cwd=cwd,
            env=env,
            nofile=nofile,
            prefix=prefix,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        )
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            out, err = proc.communicate()
            raise AssertionError(
                f"{' '.join(map(str, argv))} as {self.name} did not end within {timeout:g} s\n"
                f"stdout:\n{out}\nstderr:\n{err}"
            ) from None
        return Result(proc.returncode, out, err)

    def on_terminal(self, argv: Sequence[str], **kw: object) -> Terminal:
        """Start ``argv`` as this account with a new pseudo-terminal as its stdin, stdout and stderr
        (as a user at a terminal runs it); ``kw`` as for :meth:`start`."""
        master, slave = os.openpty()
        try:
            proc = self.start(argv, stdin=slave, stdout=slave, stderr=slave, **kw)  # type: ignore[arg-type]
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        return Terminal(proc, master)

    def python_code(self, code: str, *args: str, **kw: object) -> Result:
        """``python -c code args`` as this account."""
        return self.run(["python", "-c", code, *args], **kw)  # type: ignore[arg-type]

    # ---------- files ----------
    def mkdir(self, path: str | os.PathLike[str], mode: int = 0o700) -> Path:
        """A new directory (parents too) owned by this account."""
        path = Path(path)
        made = []
        probe = path
        while not probe.exists():
            made.append(probe)
            probe = probe.parent
        for p in reversed(made):
            p.mkdir()
            os.chown(p, self.uid, self.gid)
            os.chmod(p, mode)
        if not made:
            os.chown(path, self.uid, self.gid)
            os.chmod(path, mode)
        return path

    def write(self, path: str | os.PathLike[str], text: str | bytes, mode: int = 0o600) -> Path:
        """A file owned by this account with ``text`` in it."""
        path = Path(path)
        if isinstance(text, str):
            path.write_text(text)
        else:
            path.write_bytes(text)
        os.chown(path, self.uid, self.gid)
        os.chmod(path, mode)
        return path

    # ---------- processes ----------
    def pids(self) -> list[int]:
        """Live processes whose real or effective uid is this account's."""
        return pids_of(self.uid)

    def kill_all(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every process of this account until none is left (or ``timeout``); what is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.pids()
            if not left or time.monotonic() > deadline:
                return left
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


class Terminal:
    """A process on a pseudo-terminal, whose output a thread reads as it comes (a full terminal
    would block it); :meth:`finish` waits for the end and returns the exit status."""

    def __init__(self, proc: subprocess.Popen, fd: int) -> None:
        import threading

        self.proc, self.fd = proc, fd
        self.seen = b""
        self._reader = threading.Thread(target=self._read, name="terminal", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError:  # EIO: every holder of the other end closed it
                return
            if not data:
                return
            self.seen += data

    def finish(self, timeout: float) -> int | None:
        """The exit status once the process ended and its output was read; None past ``timeout``."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(10)
        return code

    def text(self) -> str:
        return self.seen.decode(errors="replace")

    def close(self) -> None:
        stop(self.proc)
        self._reader.join(10)
        with contextlib.suppress(OSError):
            os.close(self.fd)


def stop(proc: subprocess.Popen, grace: float = 2.0) -> None:
    """End ``proc`` and its session (SIGTERM, then SIGKILL after ``grace``) and reap it."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _uids(pid: str) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    real, effective = line.split()[1:3]
                    state = ""
                    break
            else:
                return None
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, ValueError):
        return None
    if state in ("Z", "X"):
        return None
    return int(real), int(effective)


def pids_of(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real or effective uid is ``uid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ids = _uids(entry)
            if ids is not None and uid in ids:
                out.append(int(entry))
    return out


def files_of(uid: int, roots: Iterable[str] = SCRATCH) -> list[str]:
    """Every path under ``roots`` owned by ``uid`` (not crossing into other file systems, links not
    followed): ``find ROOT -xdev -uid UID``."""
    found: list[str] = []
    for root in roots:
        try:
            dev = os.lstat(root).st_dev
        except OSError:
            continue
        for top, dirs, files in os.walk(root, onerror=lambda _e: None):
            keep = []
            for name in dirs:
                path = os.path.join(top, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if st.st_uid == uid:
                    found.append(path)
                if st.st_dev == dev and stat.S_ISDIR(st.st_mode):
                    keep.append(name)
            dirs[:] = keep
            for name in files:
                path = os.path.join(top, name)
                try:
                    if os.lstat(path).st_uid == uid:
                        found.append(path)
                except OSError:
                    continue
    return found


def remove_paths(paths: Iterable[str]) -> None:
    """Remove files, links and whole directories (deepest first); what is gone already is skipped."""
    for path in sorted(set(paths), key=lambda p: p.count("/"), reverse=True):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


# ---------------------------------------------------------------- looking at an account's processes (as root)
def environ(pid: int) -> dict[str, str]:
    """``/proc/<pid>/environ`` (empty when the process is gone or cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def with_env(uid: int, key: str) -> list[tuple[int, dict[str, str]]]:
    """(pid, environment) of every live process of ``uid`` whose environment has ``key``."""
    out = []
    for pid in pids_of(uid):
        env = environ(pid)
        if key in env:
            out.append((pid, env))
    return out


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def fd_count(pid: int) -> int:
    """Open descriptors of ``pid`` (0 once it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    out.add(target[8:-1])
    except OSError:
        pass
    return out


def listening_ports(pid: int) -> set[int]:
    """TCP ports ``pid`` holds a listening socket of (in its network namespace's tables)."""
    inodes = _socket_inodes(pid)
    ports = set()
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            with open(table) as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


class FdWatch:
    """Samples the descriptor counts of some processes on a thread; :attr:`peak` per pid."""

    def __init__(self, pids: Iterable[int] = (), interval: float = 0.02) -> None:
        import threading

        self.pids: set[int] = set(pids)
        self.peak: dict[int, int] = {}
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fd-watch", daemon=True)
        self._thread.start()

    def add(self, pid: int) -> None:
        self.pids.add(pid)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in list(self.pids):
                self.peak[pid] = max(self.peak.get(pid, 0), fd_count(pid))
            self._stop.wait(self.interval)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join(5)
        return dict(self.peak)


# ---------------------------------------------------------------- POSIX ACLs, without setfacl
ACL_XATTR = "system.posix_acl_access"
ACL_VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
NO_ID = 0xFFFFFFFF
ENTRY = struct.Struct("<HHI")


def _acl_read(path: str) -> list[tuple[int, int, int]]:
    """The entries of ``path``'s access ACL: (tag, perm, id); the mode's three when it has none."""
    try:
        raw = os.getxattr(path, ACL_XATTR)
    except OSError:
        mode = os.stat(path).st_mode
        return [(USER_OBJ, (mode >> 6) & 7, NO_ID), (GROUP_OBJ, (mode >> 3) & 7, NO_ID), (OTHER, mode & 7, NO_ID)]
    entries = [ENTRY.unpack_from(raw, off) for off in range(4, len(raw), ENTRY.size)]
    return [e for e in entries if e[0] != MASK] + [e for e in entries if e[0] == MASK]


def _acl_write(path: str, entries: list[tuple[int, int, int]]) -> None:
    named = [e for e in entries if e[0] in (USER, GROUP)]
    base = {e[0]: e for e in entries if e[0] in (USER_OBJ, GROUP_OBJ, OTHER)}
    if not named:  # back to a plain mode
        with contextlib.suppress(OSError):
            os.removexattr(path, ACL_XATTR)
        mode = (base[USER_OBJ][1] << 6) | (base[GROUP_OBJ][1] << 3) | base[OTHER][1]
        os.chmod(path, (os.stat(path).st_mode & 0o7000) | mode)
        return
    mask = base[GROUP_OBJ][1]
    for e in named:
        mask |= e[1]
    full = [*base.values(), *named, (MASK, mask, NO_ID)]
    full.sort(key=lambda e: (e[0], e[2] if e[0] in (USER, GROUP) else 0))
    os.setxattr(path, ACL_XATTR, struct.pack("<I", ACL_VERSION) + b"".join(ENTRY.pack(*e) for e in full))


def acl_grant(path: str, uids: Iterable[int], perm: int = 1) -> None:
    """Add (or widen) a named-user entry of ``perm`` for each uid to ``path``'s access ACL."""
    entries = _acl_read(path)
    for uid in uids:
        old = [e for e in entries if e[0] == USER and e[2] == uid]
        entries = [e for e in entries if not (e[0] == USER and e[2] == uid)]
        entries.append((USER, perm | (old[0][1] if old else 0), uid))
    _acl_write(path, entries)


def acl_revoke(path: str, uids: Iterable[int]) -> None:
    """Remove the named-user entries of ``uids`` (others' stay); a plain mode again when none is left."""
    gone = set(uids)
    entries = _acl_read(path)
    if not any(e[0] == USER and e[2] in gone for e in entries):
        return
    _acl_write(path, [e for e in entries if not (e[0] == USER and e[2] in gone)])


def acl_users(path: str) -> set[int]:
    """uids with a named entry in ``path``'s access ACL."""
    try:
        return {e[2] for e in _acl_read(path) if e[0] == USER}
    except OSError:
        return set()


def closed_dirs(paths: Iterable[str]) -> list[str]:
    """Directories at or above ``paths`` that others may not search (no ``o+x``)."""
    out: list[str] = []
    for path in paths:
        probe = os.path.realpath(path)
        if not os.path.isdir(probe):
            probe = os.path.dirname(probe)
        while True:
            try:
                if not os.stat(probe).st_mode & stat.S_IXOTH and probe not in out:
                    out.append(probe)
            except OSError:
                pass
            if probe == "/":
                break
            probe = os.path.dirname(probe)
    return out


def python_paths() -> list[str]:
    """What an account needs to reach to run this interpreter with this project importable."""
    import site
    import sysconfig

    paths = [sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix, str(REPO)]
    paths += [p for p in (sysconfig.get_config_var("LIBDIR"),) if p]
    paths += site.getsitepackages()
    return [p for p in paths if p and os.path.exists(p)]


# ---------------------------------------------------------------- the lab
CHECK_IMPORTS = (
    "import sys, pytest, psutil, filelock, hypothesis, pytest_msrun, pytest_msrun.plugin; "
    "print(sys.executable, pytest_msrun.__file__)"
)


@dataclass
class UserLab:
    """The victim and the attacker accounts: :meth:`up` creates them, :meth:`down` removes them."""

    victim: Account | None = None  # type: ignore[assignment]
    attacker: Account | None = None  # type: ignore[assignment]
    granted: list[str] = field(default_factory=list)  # directories with ACL entries of ours

    @property
    def accounts(self) -> list[Account]:
        return [a for a in (self.victim, self.attacker) if a is not None]

    def up(self) -> UserLab:
        reason = unusable_reason()
        if reason:
            raise UserLabError(reason)
        try:
            self.victim = self._add("msrv")
            self.attacker = self._add("msra")
            self.grant_python()
            for account in self.accounts:
                got = account.python_code(CHECK_IMPORTS, cwd=account.home, timeout=120)
                if got.returncode != 0:
                    raise UserLabError(
                        f"{account.name} cannot run {account.python} with this project importable "
                        f"(is {REPO} or site-packages closed to other users?):\n{got.output}"
                    )
                import pytest_msrun

                if os.path.dirname(pytest_msrun.__file__) not in got.stdout:
                    raise UserLabError(
                        f"{account.name} imports another pytest_msrun than the tests ({pytest_msrun.__file__}): "
                        f"{got.stdout.strip()}"
                    )
        except BaseException:
            with contextlib.suppress(Exception):
                self.down()
            raise
        return self

    def _add(self, prefix: str) -> Account:
        os.makedirs("/home", mode=0o755, exist_ok=True)
        for _ in range(20):
            name = f"{prefix}{secrets.token_hex(4)}"
            try:
                pwd.getpwnam(name)
                continue
            except KeyError:
                pass
            home = Path("/home") / name
            if home.exists():
                continue
            proc = subprocess.run(
                ["useradd", "--create-home", "--home-dir", str(home), "--user-group", "--shell", "/bin/sh", name],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if proc.returncode != 0:
                raise UserLabError(f"useradd {name} exited {proc.returncode}: {proc.stderr.strip()}")
            entry = pwd.getpwnam(name)
            os.chmod(home, 0o700)
            return Account(name, entry.pw_uid, entry.pw_gid, home)
        raise UserLabError(f"no free account name {prefix}<hex>")

    def grant_python(self) -> None:
        """Search permission on the directories above the interpreter, site-packages and the
        repository that others may not search - for these two accounts only."""
        uids = [a.uid for a in self.accounts]
        for directory in closed_dirs(python_paths()):
            try:
                acl_grant(directory, uids)
            except OSError as exc:
                raise UserLabError(
                    f"{directory} is closed to other users (mode {stat.filemode(os.stat(directory).st_mode)}) and "
                    f"an ACL entry cannot be added there ({exc}); install Python where other users can run it"
                ) from None
            self.granted.append(directory)

    def kill_all(self) -> list[int]:
        """SIGKILL every process of both accounts; the pids still there after 10 s."""
        return [pid for account in self.accounts for pid in account.kill_all()]

    def down(self) -> None:
        """Remove both accounts and everything of theirs; raise :class:`UserLeak` if anything is left."""
        problems: list[str] = []
        left = self.kill_all()
        if left:
            problems.append(f"processes that survived SIGKILL: {left}")
        for directory in self.granted:
            with contextlib.suppress(OSError):
                acl_revoke(directory, [a.uid for a in self.accounts])
        for account in self.accounts:
            proc = subprocess.run(["userdel", "--remove", account.name], capture_output=True, text=True, timeout=60)
            with contextlib.suppress(KeyError):
                pwd.getpwnam(account.name)
                problems.append(f"userdel {account.name} exited {proc.returncode}: {proc.stderr.strip()}")
            remove_paths([str(account.home), *files_of(account.uid)])
        problems += self.leftovers()
        if problems:
            raise UserLeak("user lab teardown left: " + "; ".join(problems))

    def leftovers(self) -> list[str]:
        """Processes and files (in the scratch places and the homes) of the accounts that still exist."""
        left = []
        for account in self.accounts:
            pids = pids_of(account.uid)
            if pids:
                left.append(f"processes of {account.name} (uid {account.uid}): {pids}")
            files = files_of(account.uid, [*SCRATCH, str(account.home)])
            if account.home.exists():
                left.append(f"home {account.home}")
            if files:
                left.append(f"files of {account.name} (uid {account.uid}): {files[:20]}")
        for directory in self.granted:
            ours = acl_users(directory) & {a.uid for a in self.accounts}
            if ours:
                left.append(f"ACL entries for uids {sorted(ours)} on {directory}")
        return left

    def __enter__(self) -> UserLab:
        return self.up() if not self.accounts else self

    def __exit__(self, *exc: object) -> None:
        self.down()
