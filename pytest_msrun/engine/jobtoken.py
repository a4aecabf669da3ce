"""The job's token: the secret every process of a job proves it knows to the control plane.

Where it comes from, first match wins (msrun's command line is unchanged):

1. ``MSRUN_JOB_TOKEN`` - given by the user, the same on every node;
2. ``MSRUN_JOB_TOKEN_FILE`` - a file holding a secret (the same file, or copies, on every node);
3. a job on one node - a random token for this job only;
4. a job on several nodes - this user's secret, ``$XDG_CONFIG_HOME/msrun/secret``
   (``~/.config/msrun/secret``, created once with mode 0600 in a 0700 directory; on a cluster the
   home directory is shared, so every node reads the same file).

From a secret, each job's token is an HMAC of the job's port and size (not its address: nodes may
name the master differently) and, inside Slurm, the job and step ids, so a token seen in one job's
environment opens no job on another port. The token reaches the job's processes only through
their environment, which only their user (and root) can read. A secret file that exists but
others may read, that belongs to another user, or that cannot be read stops msrun before anything
starts (:class:`TokenError`, as ssh refuses such a key file): a secret that may be known is no
secret. Only where no secret exists at all (and none can be made) does the job run
unauthenticated, and msrun says so loudly.

A token or secret given by the user must not be guessable (:func:`wire.weakness`: at least 16
characters, 8 different ones, no short part repeated); a passphrase - anything but 32 or more hex
digits - is stretched into the job's key (:func:`wire.strengthen`), which is what the job's
processes hold: a handshake recorded on the network costs an offline guesser that stretch per guess.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from pytest_msrun.control.wire import strengthen, weakness
from pytest_msrun.engine import suppress
from pytest_msrun.fileio import describe_kind
from pytest_msrun.fileio import unsafe_directory as _unsafe_directory
from pytest_msrun.record import record

TOKEN_ENV = "MSRUN_JOB_TOKEN"
TOKEN_FILE_ENV = "MSRUN_JOB_TOKEN_FILE"
RANDOM_HINT = "python -c 'import secrets; print(secrets.token_hex(32))'"


class TokenError(ValueError):
    """A secret file msrun must not use: it names the file and the fix."""


@record
class JobToken:
    token: str  # "" = unauthenticated
    source: str  # where it came from, for the plan and the status (never the secret itself)
    warning: str = ""


def secret_path(env: Mapping[str, str]) -> str:
    base = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".config")
    return os.path.join(base, "msrun", "secret")


def derive(secret: str, *identity: object) -> str:
    """This job's token from a long-lived secret (a passphrase stretched first: :func:`wire.strengthen`)."""
    import hmac

    msg = "\0".join(["msrun-job-v1", *map(str, identity)]).encode()
    return hmac.digest(strengthen(secret).encode(), msg, "sha256").hex()[:32]


SECRET_LIMIT = 4096  # bytes read from a secret file at most: a secret is one line


def _read_secret(path: str) -> tuple[str, str]:
    """(secret, problem) from a secret file, which must be a regular file of this user's that
    no one else may read, in directories no one else may write (as ssh requires of a key).

    Opened without blocking (a FIFO or a device must not hold msrun forever), checked on the
    open descriptor (what is read is what was checked), read up to :data:`SECRET_LIMIT` bytes."""
    fd = -1
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):  # (a socket cannot even be opened: say what it is)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            st = os.fstat(fd)  # what is read is what is checked, whatever was swapped in meanwhile
        if not stat.S_ISREG(st.st_mode):
            kind = describe_kind(st.st_mode)
            return "", f"is not a regular file ({kind}); write the secret into a file of yours, mode 600"
        if st.st_uid != os.getuid():
            return "", f"belongs to another user (uid {st.st_uid}); use a file of your own, mode 600"
        if st.st_mode & 0o077:
            return "", f"others may read it (mode {st.st_mode & 0o777:o}); run: chmod 600 {path}"
        problem = _unsafe_directory(path)
        if problem:
            return "", problem
        raw = b""
        while len(raw) <= SECRET_LIMIT:
            chunk = os.read(fd, SECRET_LIMIT + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    except OSError as exc:
        return "", f"cannot be read ({exc.strerror or exc}); make it a file of yours: chmod 600 {path}"
    finally:
        if fd >= 0:
            os.close(fd)
    if len(raw) > SECRET_LIMIT:
        return "", f"is larger than {SECRET_LIMIT} bytes; a secret is one line of random text"
    try:
        secret = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        return "", f"is not UTF-8 text (byte {exc.start}); write a random hex secret into it, mode 600"
    weak = weakness(secret)
    if weak:
        return "", f"{weak}: a guessable secret; write a long random secret into it (mode 600): {RANDOM_HINT}"
    return secret, ""


def user_secret(env: Mapping[str, str]) -> tuple[str, str]:
    """This user's msrun secret, created on first use; (secret, problem).

    Created whole or not at all: written to a private temporary file, then hard-linked to its
    name, which fails if another node (shared home) or msrun got there first - so no reader ever
    sees a half-written secret, and every racer ends up with the winner's. Never created in a
    directory someone else could write (:class:`TokenError`, as for a secret found there)."""
    path = secret_path(env)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            unsafe = _unsafe_directory(path)
            if unsafe:
                raise TokenError(f"the msrun secret {path}: {unsafe}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(os.urandom(32).hex() + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.link(tmp, path)
        except FileExistsError:
            pass  # another node (shared home) or msrun created it just now
        except OSError as exc:
            return "", f"cannot create {path}: {exc.strerror or exc}"
        finally:
            with suppress(OSError):
                os.unlink(tmp)
    return _read_secret(path)


def job_token(
    *, multi_node: bool, master_ip: str, master_port: int, worker_num: int, env: Mapping[str, str], scope: str = ""
) -> JobToken:
    """``scope``: what makes this job unique beyond its port and size (a Slurm job and step)."""
    given = env.get(TOKEN_ENV, "")
    if given:
        try:
            given.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8, as os.environ holds them
            raise TokenError(f"{TOKEN_ENV} is not UTF-8 text; set it to a random hex secret") from None
        weak = weakness(given)
        if weak:
            raise TokenError(f"{TOKEN_ENV} {weak}: a guessable token; set it to a long random secret: {RANDOM_HINT}")
        return JobToken(strengthen(given), TOKEN_ENV)
    identity: tuple[object, ...] = (master_port, worker_num, scope) if scope else (master_port, worker_num)
    path = env.get(TOKEN_FILE_ENV, "")
    if path:
        secret, problem = _read_secret(path)
        if not secret:
            raise TokenError(f"{TOKEN_FILE_ENV}={path}: {problem}")
        return JobToken(derive(secret, *identity), f"{TOKEN_FILE_ENV}={path}")
    if not multi_node:
        return JobToken(os.urandom(16).hex(), "random, this job only")
    secret, problem = user_secret(env)
    if secret:
        return JobToken(derive(secret, *identity), f"this user's secret {secret_path(env)}")
    if os.path.exists(secret_path(env)):  # there, but unusable: fail closed
        raise TokenError(f"the msrun secret {secret_path(env)}: {problem}")
    return JobToken(
        "",
        "none",
        f"this job runs WITHOUT authentication ({problem}): any process that can reach "
        f"{master_ip}:{master_port} can join it or abort it. Set {TOKEN_ENV} to the same secret on every "
        f"node, or {TOKEN_FILE_ENV} to a file only you can read.",
    )
