"""In-rank API, modelled on ``mindspore.communication``: ``init``, ranks, collectives.

Under ``msrun`` with the builtin scheduler, :func:`init` joins the job's communication group
through the control plane; :func:`barrier`, :func:`all_gather_object` and
:func:`broadcast_object` then synchronise ranks. If a peer dies or leaves, a rank blocked in a
collective gets :class:`ClusterAborted`/:class:`ClusterError` promptly instead of hanging.

In a dry run (``MS_SIMULATION_LEVEL``) :func:`init` succeeds without a scheduler and ranks and
sizes come from the environment; simulated ranks run independently (even in separate waves),
so :func:`barrier` returns at once - the one collective whose meaning survives - while
:func:`all_gather_object` and :func:`broadcast_object`, whose results would need the other
ranks, raise :class:`ClusterError`. Outside msrun (no ``MS_ROLE``) the group is a world of one
and every collective completes locally.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import threading
import time

from pytest_msrun.control import calls, wire

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "ClusterAborted",
    "ClusterError",
    "CollectiveDeadlock",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "finalize",
    "get_group_size",
    "get_local_rank",
    "get_local_rank_size",
    "get_rank",
    "init",
    "is_dryrun",
    "is_initialized",
]

# pytest leaves this module's frames out of a failure's traceback, as plugins do with their own
# (``--full-trace`` shows them): a failed collective points at the user's call, not its internals
__tracebackhide__ = True

NOT_INITED = (
    "Distributed Communication has not been inited.You can't invoke this interface yet. "
    "Please call `init()` method first."
)


HISTORY_LIMIT = 4096
# The collectives this process ran, newest last: (op, seq, entered, returned, error) on the wall
# clock. What a test's report shows of its ranks (the pytest plugin reads it after each phase).
history: list[tuple[str, int, float, float, str]] = []


def _remember(op: str, seq: int, entered: float, error: str) -> None:
    history.append((op, seq, entered, time.time(), error))
    if len(history) > HISTORY_LIMIT:
        del history[: HISTORY_LIMIT // 2]


class ClusterError(RuntimeError):
    """A collective or the group itself failed."""


class ClusterAborted(ClusterError):
    """The job is being torn down because another process failed."""


class CollectiveDeadlock(ClusterError):
    """A collective that can never complete: a peer left the job, left the test's call, is waiting
    in another collective, or called another operation (the message names each and where it is)."""


API_NAMES = {"barrier": "barrier", "gather": "all_gather_object", "bcast": "broadcast_object"}


def _where() -> tuple[str, str] | None:
    """The test phase this process is in (pytest's ``PYTEST_CURRENT_TEST``: "nodeid (call)")."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    nodeid, _, when = current.rpartition(" (")
    when = when.rstrip(")")
    if not nodeid or when not in ("setup", "call", "teardown"):
        return None
    return nodeid, when


def _env_int(name: str, default: int, env: dict[str, str] | None = None) -> int:
    value = (env if env is not None else os.environ).get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        return default


class _Group:
    def __init__(self, rank: int, world: int, channel: wire.Channel | None, mode: str) -> None:
        self.rank = rank
        self.world = world
        self.channel = channel
        self.mode = mode  # "cluster" | "dryrun" | "standalone"
        self.seq = 0
        self.lock = threading.Lock()  # one collective at a time
        # (op, seq, src, test phase) of a collective whose timeout= ran out here: the rank is still in it
        self.pending: tuple[str, int, int, tuple[str, str] | None] | None = None
        self.send_lock = threading.Lock()  # one frame at a time (a call notice beside a collective)

    def collective(self, op: str, data: bytes | None, src: int, timeout: float | None) -> Any:
        if self.mode == "dryrun" and op != "barrier":
            raise ClusterError(
                f"{API_NAMES[op]} is not available in a dry run (MS_SIMULATION_LEVEL): simulated ranks run "
                "independently and cannot see each other's objects; derive other ranks' values from "
                "get_rank()/get_group_size() instead"
            )
        if self.channel is None:
            if op == "gather":
                return [data] * self.world
            return data
        with self.lock:
            entered = time.time()
            deadline = None if timeout is None else time.monotonic() + timeout
            where = _where()
            pending = self.pending
            if pending is not None and (pending[0], pending[2], pending[3]) == (op, src, where):
                seq, msg = pending[1], None  # a retry: it waits for that call again
            else:
                if pending is not None:
                    self._finish_pending(op, timeout, deadline)
                seq = self.seq + 1
                msg = self._message(op, seq, src, data, where)
                self.seq = seq
            try:
                result = self._exchange(op, seq, msg, src, timeout, deadline)
            except ClusterError as exc:
                _remember(op, seq, entered, str(exc))
                raise
            _remember(op, seq, entered, "")
            return result

    def _finish_pending(self, op: str, timeout: float | None, deadline: float | None) -> None:
        """Another collective while the rank is still in one whose ``timeout=`` ran out (a rank is
        in one at a time): that one completes or fails first - its peers enter it, or the control
        plane fails it once they moved on - and only then does ``op`` begin, in step with them."""
        assert self.pending is not None
        was_op, was_seq, was_src, _ = self.pending
        try:
            self._exchange(was_op, was_seq, None, was_src, timeout, deadline)
        except CollectiveDeadlock:
            pass  # it failed: the rank is out of it
        except ClusterError:
            if self.pending is None:  # not a timeout: the connection, an abort
                raise
            raise ClusterError(
                f"{op} timed out after {timeout:g} s on rank {self.rank}: it waited for "
                f"{calls.op_name(was_op)} #{was_seq}, whose timeout ran out on this rank, to complete or fail"
            ) from None

    def _message(
        self, op: str, seq: int, src: int, data: bytes | None, where: tuple[str, str] | None
    ) -> dict[str, Any]:
        """This rank's part of collective ``seq``, as a frame; :class:`ClusterError` (nothing sent)
        when it would exceed the message limit, which the control plane would answer by dropping
        this rank's connection."""
        msg: dict[str, Any] = {"t": "coll", "op": op, "seq": seq, "src": src}
        if where is not None:  # the control plane pairs a test's collectives within the test
            msg["test"], msg["when"] = where
            if calls.place > 0:  # the test's place in the session (every rank runs them in one order)
                msg["order"] = calls.place
        if data is None:
            return msg
        # the frame's body once the data is added (a base64 ``data`` field), without encoding it
        size = len(wire.encode(msg)) - wire.HEADER.size + len(',"data":""') + 4 * ((len(data) + 2) // 3)
        limit = wire.message_limit()
        if size > limit:
            raise ClusterError(
                f"{API_NAMES.get(op, op)} on rank {self.rank}: this rank's object pickles to {len(data)} bytes, a "
                f"message of {size} bytes, over the limit of {limit} bytes ({wire.LIMIT_ENV}); send less, or raise "
                f"{wire.LIMIT_ENV} in msrun's environment (every process of the job reads it)"
            )
        msg["data"] = wire.pack_data(data)
        return msg

    def _exchange(
        self, op: str, seq: int, msg: dict[str, Any] | None, src: int, timeout: float | None, deadline: float | None
    ) -> Any:
        """Send this rank's part of collective ``seq`` (``msg``; None: sent already) and wait for
        its result until ``deadline``. When it passes the rank is still in it: :attr:`pending`."""
        assert self.channel is not None
        self.pending = None
        try:
            if msg is not None:
                with self.send_lock:
                    self.channel.send(msg)
        except OSError as exc:
            raise ClusterError(f"{op}: lost the scheduler connection ({exc})") from None
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                reply = self.channel.recv(remaining)
            except socket.timeout:
                self.pending = (op, seq, src, _where())
                raise ClusterError(f"{op} timed out after {timeout:g} s on rank {self.rank}") from None
            except (OSError, wire.ProtocolError) as exc:
                raise ClusterError(f"{op}: lost the scheduler connection ({exc})") from None
            kind = reply.get("t")
            if kind == "abort":
                raise ClusterAborted(f"job aborted: {reply.get('reason')}")
            if kind == "refused":  # this rank broke the protocol: the control plane dropped it
                raise ClusterError(f"{calls.op_name(op)} on rank {self.rank}: refused: {reply.get('reason')}")
            if kind == "error":
                if reply.get("seq", seq) != seq:  # an earlier collective's, whose wait this rank gave up
                    continue
                rewind = reply.get("rewind")
                if wire.is_int(rewind, 0, seq - 1) and seq == self.seq:
                    self.seq = rewind  # the peers never entered it: it counts for no one (stay in step)
                raise CollectiveDeadlock(f"{calls.op_name(op)} failed on rank {self.rank}: {reply.get('reason')}")
            if kind == "coll" and reply.get("seq") == seq:
                data_out = reply.get("data")
                if op == "gather":
                    if not isinstance(data_out, list) or len(data_out) != self.world:
                        raise ClusterError(f"{op} on rank {self.rank}: malformed reply from the scheduler")
                    return [self._unpack(op, part, peer) for peer, part in enumerate(data_out)]
                return None if data_out is None else self._unpack(op, data_out, src)

    def _unpack(self, op: str, part: Any, peer: int) -> bytes:
        """Rank ``peer``'s part of a collective's result; :class:`ClusterError` naming it when it sent
        something other than base64."""
        try:
            return wire.unpack_data(part)
        except wire.ProtocolError as exc:
            raise ClusterError(
                f"{calls.op_name(op)} on rank {self.rank}: rank {peer} sent data that is not an object's ({exc})"
            ) from None

    def note_call(self, test: str, entered: bool, outcome: str) -> None:
        """Tell the control plane this rank entered or left ``test``'s call phase."""
        channel = self.channel
        if channel is None:
            return
        msg = {"t": "call", "test": test, "state": "in" if entered else "out", "outcome": outcome}
        idle = self.lock.acquire(blocking=False)  # no collective waiting on the socket's timeout
        try:
            with self.send_lock:
                if idle:
                    channel.send(msg)
                else:  # a thread waits in a collective: the socket's mode stays its own
                    channel.sock.sendall(wire.encode(msg))
        except (OSError, ValueError):
            pass  # a connection gone: the collectives learn of it themselves
        finally:
            if idle:
                self.lock.release()

    def close(self) -> None:
        if self.channel is not None:
            try:
                msg = {"t": "bye"}
                where = _where()
                if where is not None:  # in a warm world or a suite, a later test may init() again
                    msg["test"], msg["when"] = where
                self.channel.send(msg)
            except OSError:
                pass
            self.channel.close()
            self.channel = None


_group: _Group | None = None
_init_lock = threading.Lock()


def is_dryrun() -> bool:
    """True inside an ``msrun --sim_level`` dry run."""
    return bool(os.environ.get("MS_SIMULATION_LEVEL", "").strip())


def is_initialized() -> bool:
    return _group is not None


def init(timeout: float | None = None) -> None:
    """Join the job's communication group (blocks until every rank joined)."""
    global _group
    with _init_lock:
        if _group is not None:
            return
        env = dict(os.environ)
        world = _env_int("RANK_SIZE", 1, env)
        rank = _env_int("RANK_ID", 0, env)
        if is_dryrun():
            _group = _Group(rank, world, None, "dryrun")
            return
        role = env.get("MS_ROLE", "")
        if not role:
            if world > 1:
                raise ClusterError(f"RANK_SIZE={world} but this process was not started by msrun (no MS_ROLE)")
            _group = _Group(rank, world, None, "standalone")
            return
        if role != "MS_WORKER":
            raise ClusterError(f"init() is for workers; this process has MS_ROLE={role}")
        mode = env.get("MSRUN_SCHEDULER", "")
        if mode not in ("auto", "builtin", "mindspore"):
            raise ClusterError(
                "pytest_msrun.control.cluster needs msrun's builtin control plane, but this job runs "
                f"--scheduler={mode or '?'} (the task itself is the scheduler); "
                "launch with msrun --scheduler=auto, builtin or mindspore"
            )
        if "RANK_ID" not in env:
            raise ClusterError("RANK_ID is not set: this worker's rank is unknown")
        if timeout is None:
            topo = _env_int("MS_TOPO_TIMEOUT", 600, env)
            timeout = None if topo < 0 else float(topo)
        deadline = time.monotonic() + (timeout if timeout is not None else 10**9)
        node = os.uname().nodename  # the control plane names the process holding a rank when another asks
        hello = {"t": "hello", "kind": "rank", "rank": rank, "world": world, "pid": os.getpid(), "host": node}
        host, port = env["MS_SCHED_HOST"], int(env["MS_SCHED_PORT"])
        try:
            channel = wire.Channel.join(host, port, hello, env.get("MSRUN_JOB_TOKEN", ""), deadline)
        except wire.Unreachable as exc:
            raise ClusterError(f"cannot reach the scheduler at {host}:{port}: {exc.__cause__}") from None
        except (OSError, wire.ProtocolError) as exc:
            raise ClusterError(f"init() failed on rank {rank}: {exc}") from None
        try:
            while True:
                try:
                    reply = channel.recv(max(0.0, deadline - time.monotonic()))
                except socket.timeout:
                    raise ClusterError(
                        f"init() timed out after {timeout:g} s waiting for all {world} ranks "
                        "(MS_TOPO_TIMEOUT, which msrun sets from --cluster_time_out)"
                    ) from None
                except (OSError, wire.ProtocolError) as exc:
                    raise ClusterError(f"init(): lost the scheduler connection ({exc})") from None
                kind = reply.get("t")
                if kind == "ready":
                    break
                if kind in ("refused", "error", "abort"):
                    cls = ClusterAborted if kind == "abort" else ClusterError
                    raise cls(f"init() failed on rank {rank}: {reply.get('reason')}")
        except ClusterError:
            channel.close()
            raise
        # No finalize() at exit: a process ending with an error must not tell its peers it left
        # cleanly while it is still shutting down. Its connection must not close during that
        # shutdown either (the socket object is collected then), or peers hear of it - and may
        # fail and exit - before msrun sees this process end and names the real first failure:
        # the descriptor is let go by Python and closed by the kernel when the process exits.
        _group = _Group(rank, world, channel, "cluster")
        atexit.register(_keep_connection_until_exit)


def _require() -> _Group:
    if _group is None:
        raise ClusterError(NOT_INITED)
    return _group


def get_rank() -> int:
    """This process's global rank (``RANK_ID`` before :func:`init`)."""
    return _group.rank if _group is not None else _env_int("RANK_ID", 0)


def get_group_size() -> int:
    """Number of ranks in the job (``RANK_SIZE`` before :func:`init`)."""
    return _group.world if _group is not None else _env_int("RANK_SIZE", 1)


def get_local_rank() -> int:
    """Index of this rank on its node."""
    return _env_int("LOCAL_RANK", 0)


def get_local_rank_size() -> int:
    """Number of ranks on this node."""
    return _env_int("LOCAL_RANK_SIZE", _env_int("LOCAL_WORLD_SIZE", 1))


def barrier(timeout: float | None = None) -> None:
    """Block until every rank reached this barrier."""
    _require().collective("barrier", None, 0, timeout)


def _loads(data: bytes, api: str, peer: int) -> Any:
    """Rank ``peer``'s object; :class:`ClusterError` when it cannot be unpickled here (chained to why)."""
    try:
        return pickle.loads(data)
    except Exception as exc:
        why = f"{api} on rank {get_rank()}: rank {peer}'s object cannot be unpickled here: {exc!r}"
        raise ClusterError(why) from exc


def all_gather_object(obj: Any, timeout: float | None = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank (objects must be picklable; its pickle must fit the message
    limit, ``MSRUN_MAX_MESSAGE_BYTES``, and every rank's together too)."""
    parts = _require().collective("gather", pickle.dumps(obj), 0, timeout)
    return [_loads(p, "all_gather_object", peer) for peer, p in enumerate(parts)]


def broadcast_object(obj: Any = None, src: int = 0, timeout: float | None = None) -> Any:
    """``obj`` of rank ``src``, on every rank."""
    group = _require()
    if not 0 <= src < group.world:
        raise ValueError(f"src {src} is outside 0..{group.world - 1}")
    data = pickle.dumps(obj) if group.rank == src else None
    out = group.collective("bcast", data, src, timeout)
    return obj if out is None else _loads(out, "broadcast_object", src)


def _keep_connection_until_exit() -> None:
    group = _group
    if group is not None and group.channel is not None:
        group.channel.sock.detach()  # the fd stays open until the process exits


def note_call(test: str, entered: bool, outcome: str = "") -> None:
    """pytest's rank plugin: this rank entered or left ``test``'s call phase. The control plane
    then fails at once a collective entered in that call that a rank which left it would never
    join (nothing is sent before :func:`init`)."""
    group = _group
    if group is not None and group.mode == "cluster":
        group.note_call(test, entered, outcome)


def finalize() -> None:
    """Leave the group (peers still in a collective with this rank then get an error)."""
    global _group
    with _init_lock:
        if _group is not None:
            _group.close()
            _group = None
