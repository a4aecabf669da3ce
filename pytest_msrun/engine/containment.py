"""A job is a unit the kernel can kill: every process it starts lives in the job's own cgroup.

At start-up msrun creates ``msrun-<job id>`` below its own cgroup and moves itself in (once, on a
background thread: the first migration into a cgroup waits for an RCU grace period, ~15 ms, which
then overlaps msrun's own planning). Everything it starts afterwards - and everything those start:
new sessions, new process groups, double-forked daemons - is inside. msrun never moves again (a
later move would cost that grace period on the failure path): at teardown it SIGKILLs every other
member of the cgroup's subtree until none is left. Its watchdog, started before msrun moved in,
stays outside; if msrun is SIGKILLed it kills the job with one write, and once msrun is gone it
removes the empty cgroup (inside a Slurm job, whose step end kills the watchdog too, msrun moves
out and removes it itself):

* cgroup v2 (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on hybrid hosts): ``cgroup.kill``
  (Linux >= 5.14), else freeze (``cgroup.freeze``), SIGKILL every member, thaw;
* cgroup v1: the ``freezer`` hierarchy: freeze, SIGKILL every task, thaw.

Where no cgroup is writable (a container without cgroup delegation, no root), the fallback does
not depend on process groups either: every child inherits ``MSRUN_LAUNCHER_ID`` (this launcher's
id; ``MSRUN_JOB_ID`` is the whole job's, which another node's launcher on the same kernel - two
``--node_rank`` on one host, namespaced nodes - shares), and the watchdog kills every process
whose environment carries it, repeating until none is left. What
that misses - a process that clears its environment, or another user's - is stated in docs/launcher.md (No survivor).
``MSRUN_CGROUP`` picks: ``auto`` (default: v2, else v1 freezer, else the sweep), ``v2``,
``freezer``, or ``off`` (the sweep only).
"""

from __future__ import annotations

import os
import time

from pytest_msrun.engine import suppress, timeline
from pytest_msrun.record import record
from pytest_msrun.waiting import wait_until

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not imported at run time: this module loads before anything else
    from typing import Callable

CGROUP_ENV = "MSRUN_CGROUP"


def _mounts() -> dict[str, str]:
    """fstype/option -> mount point: ``cgroup2`` and the v1 ``freezer`` hierarchy."""
    out: dict[str, str] = {}
    with suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            head, sep, tail = line.partition(" - ")
            if not sep:
                continue
            mount, post = head.split()[4], tail.split()
            if post[0] == "cgroup2":
                out.setdefault("cgroup2", mount)
            elif post[0] == "cgroup" and len(post) > 2 and "freezer" in post[2].split(","):
                out.setdefault("freezer", mount)
    return out


def _own_paths() -> dict[str, str]:
    """Hierarchy (``""`` for v2, else the v1 controllers) -> this process's cgroup path."""
    out: dict[str, str] = {}
    with suppress(OSError), open("/proc/self/cgroup", encoding="utf-8") as fh:
        for line in fh:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3:
                out[parts[1]] = parts[2]
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as fh:
        fh.write(text)


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read()
    except OSError:
        return ""


@record
class JobCgroup:
    """The job's cgroup: ``kind`` is ``v2`` or ``freezer`` (v1)."""

    kind: str
    path: str
    home: str  # the cgroup msrun returns to after starting processes

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def describe(self) -> str:
        return f"cgroup {'v2' if self.kind == 'v2' else 'v1 freezer'} {self.path}"

    def members(self) -> list[int]:
        """Every process in the job's cgroup and its sub-cgroups (nested msrun jobs)."""
        return [int(p) for root, _, _ in os.walk(self.path) for p in _read(os.path.join(root, "cgroup.procs")).split()]

    def leave(self) -> None:
        """Move this process back to where it came from (it is not part of the job)."""
        with suppress(OSError):
            _write(os.path.join(self.home, "cgroup.procs"), "0")

    def kill_others(self, spare: set[int]) -> list[int]:
        """SIGKILL every member but this process (and ``spare``) until none is left; the pids hit."""
        keep = {os.getpid(), *spare}
        hit: list[int] = []
        for _ in range(200):
            others = [p for p in self.members() if p not in keep]
            if not others:
                break
            for pid in others:
                with suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, 9)  # SIGKILL (the signal module is not loaded this early)
                    hit.append(pid)
            time.sleep(0.001)
        return hit

    def remove(self, timeout: float = 5.0) -> bool:
        """Remove the (emptied) cgroup and any empty cgroups below it (nested jobs whose own
        watchdog was killed); False if it still had members after ``timeout``."""

        def gone() -> bool:
            for root, _dirs, _files in os.walk(self.path, topdown=False):
                with suppress(OSError):
                    os.rmdir(root)
            return not os.path.isdir(self.path)

        return wait_until(gone, timeout, 0.005)

    def watchdog_line(self) -> str:
        """What the watchdog needs to kill this job and remove the cgroup (see Watchdog)."""
        kill = "kill" if self.kind == "v2" and os.path.exists(os.path.join(self.path, "cgroup.kill")) else "freeze"
        return f"cgroup {self.kind} {kill} {self.path}"


def create(job_id: str, env: dict[str, str], made: Callable[[JobCgroup], None] | None = None) -> JobCgroup | None:
    """Create the job's cgroup below this process's own and move this process into it.

    ``made`` is told each cgroup created, before this process moves in (the watchdog must know
    it from then on: it removes it if msrun dies). None where no cgroup can be created or entered
    (no cgroup filesystem, no delegation, not root, or ``MSRUN_CGROUP=off``).
    """
    want = env.get(CGROUP_ENV, "auto").strip().lower()
    if want in ("off", "0", "no", "false"):
        return None
    mounts, own = _mounts(), _own_paths()
    name = f"msrun-{job_id}-{os.getpid()}"  # its msrun's PID: see sweep_stale
    candidates = []
    if "cgroup2" in mounts and "" in own:
        candidates.append(("v2", mounts["cgroup2"], own[""]))
    if "freezer" in mounts:
        path = next((p for ctl, p in own.items() if "freezer" in ctl.split(",")), None)
        if path is not None:
            candidates.append(("freezer", mounts["freezer"], path))
    for kind, mount, own_path in candidates:
        if want in ("v2", "freezer") and kind != want:
            continue
        home = os.path.join(mount, own_path.lstrip("/"))
        sweep_stale(home)
        path = os.path.join(home, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        job = JobCgroup(kind, path, home)
        if made is not None:
            made(job)
        try:
            _write(job.procs_file, "0")  # this process (and so all it forks from now on) moves in
        except OSError:
            job.remove(0)
            continue
        return job
    return None


def sweep_stale(home: str) -> None:
    """Remove the empty job cgroups in ``home`` whose msrun is gone: left where msrun and its
    watchdog were killed together (Slurm cancelling a step SIGKILLs every process of it, and then
    no one removes the cgroup); the next msrun below the same cgroup clears them. A cgroup with
    members, or whose msrun still runs (it may not have moved in yet), is kept."""
    try:
        names = os.listdir(home)
    except OSError:
        return
    for name in names:
        owner = name.rpartition("-")[2]
        if not name.startswith("msrun-") or not owner.isdigit() or int(owner) == os.getpid():
            continue
        if os.path.exists(f"/proc/{owner}"):  # alive (or a zombie: its parent still reaps it)
            continue
        with suppress(OSError):
            os.rmdir(os.path.join(home, name))  # fails unless empty: a cgroup with members stays


class Entering:
    """``create`` on a background thread, so the migration overlaps msrun's own start-up."""

    SWITCH_INTERVAL = 0.0002  # while it runs: the main thread imports and must not keep the GIL 5 ms at a time
    THREAD_END = 0.2  # s to wait for the thread to be gone once it is done (it ends at once when let run)

    def __init__(self, job_id: str, env: dict[str, str], made: Callable[[JobCgroup], None] | None = None) -> None:
        import _thread  # not threading: this runs before msrun has imported anything
        import sys

        self.result: JobCgroup | None = None
        self.interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self.interval, self.SWITCH_INTERVAL))
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.threads_before = _thread._count()
        _thread.start_new_thread(self._run, (job_id, env, made))

    def _run(self, job_id: str, env: dict[str, str], made: Callable[[JobCgroup], None] | None) -> None:
        try:
            self.result = create(job_id, env, made)
        except Exception:  # never fatal: the job then runs with the environment sweep
            self.result = None
        finally:
            self.done.release()

    def wait(self) -> JobCgroup | None:
        """The job's cgroup once this process is inside it (call before starting any process)."""
        import _thread
        import sys

        self.done.acquire()
        self.done.release()
        # The thread has said it is done but may still be ending, and it needs the GIL to end: let
        # it go, so that from here on this process runs one thread again - msrun forks its
        # control plane only then (a fork copies just the calling thread); caught alive, msrun
        # had to start the control plane as a second interpreter instead.
        wait_until(lambda: _thread._count() <= self.threads_before, self.THREAD_END, 0.0001)
        sys.setswitchinterval(self.interval)
        return self.result


_WATCHDOG = r"""
trap '' INT TERM HUP QUIT
groups="" jobs="" cg="" cgkind="" cgmode="" finished=""
while IFS= read -r line; do
  case "$line" in
    done) finished=1 ;;
    "job "*) jobs="$jobs ${line#job }" ;;
    "cgroup "*) set -- $line; cgkind=$2; cgmode=$3; cg=$4 ;;
    *) groups="$groups -$line" ;;
  esac
done
if [ -z "$finished" ]; then
  [ -n "$groups" ] && kill -s KILL -- $groups 2>/dev/null
  if [ -n "$cg" ]; then
    if [ "$cgmode" = kill ]; then
      echo 1 > "$cg/cgroup.kill" 2>/dev/null
    else
      if [ "$cgkind" = v2 ]; then echo 1 > "$cg/cgroup.freeze"; else echo FROZEN > "$cg/freezer.state"; fi 2>/dev/null
      n=0
      while [ $n -lt 50 ]; do
        left=$(cat "$cg/cgroup.procs" 2>/dev/null)
        [ -z "$left" ] && break
        kill -s KILL $left 2>/dev/null
        n=$((n+1))
      done
      if [ "$cgkind" = v2 ]; then echo 0 > "$cg/cgroup.freeze"; else echo THAWED > "$cg/freezer.state"; fi 2>/dev/null
    fi
  fi
  for job in $jobs; do
    n=0
    while [ $n -lt 20 ]; do
      hits=$(grep -lsazx -- "MSRUN_LAUNCHER_ID=$job" /proc/[0-9]*/environ 2>/dev/null)
      [ -z "$hits" ] && break
      for f in $hits; do
        p=${f#/proc/}; p=${p%/environ}
        [ "$p" != "$$" ] && kill -s KILL "$p" 2>/dev/null
      done
      n=$((n+1))
    done
  done
fi
if [ -n "$cg" ]; then
  n=0
  while [ -d "$cg" ] && ! rmdir "$cg" 2>/dev/null && [ $n -lt 500 ]; do sleep 0.02; n=$((n+1)); done
fi
exit 0
"""


class Watchdog:
    """``sh`` that kills the whole job if this launcher dies without saying ``done``.

    It is told the job's process groups, its launcher's id (every child inherits ``MSRUN_LAUNCHER_ID``) and its
    cgroup. If the launcher is SIGKILLed, it kills the groups, then the cgroup in one write (or
    freezes it and kills every member), then every process carrying the launcher's id; in any case it
    removes the job's cgroup once it is empty (after the launcher, which lives in it, is gone).
    It reads its orders from a pipe whose end of file - the launcher gone - is its signal.
    """

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pipe: int | None = None  # the write end, in this process
        read_end, write_end = os.pipe()
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            dup = os.POSIX_SPAWN_DUP2
            actions = [(dup, read_end, 0), (dup, null, 1), (dup, null, 2)]
            argv = ["/bin/sh", "-c", _WATCHDOG]
            self.pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions, setsid=True, setsigmask=())
            self.pipe = write_end
        except OSError:
            os.close(write_end)
        finally:
            os.close(read_end)
            os.close(null)

    def tell(self, line: str) -> None:
        if self.pipe is not None:
            with suppress(OSError):
                os.write(self.pipe, f"{line}\n".encode())

    def job(self, job_id: str) -> None:
        """Processes whose environment carries ``MSRUN_LAUNCHER_ID=job_id`` (exactly) belong to the job."""
        self.tell(f"job {job_id}")

    def let_go(self) -> None:
        """Close this process's end of the pipe without a word (another process holds it too)."""
        if self.pipe is not None:
            with suppress(OSError):
                os.close(self.pipe)
            self.pipe = None

    def stand_down(self) -> None:
        """The launcher cleaned up itself: the watchdog kills nothing, removes the empty cgroup
        once the launcher is gone, and exits (it is not waited for: that happens after we exit)."""
        self.tell("done")
        self.let_go()


class JobGuard:
    """What makes sure a job never outlives msrun: the watchdog (started first, so it stays
    outside the job's cgroup) and the job's cgroup, which msrun enters in the background."""

    def __init__(self, job_id: str, env: dict[str, str]) -> None:
        self.job_id = job_id
        self.watchdog = Watchdog()
        self.watchdog.job(job_id)
        # made: told on the entering thread, before msrun moves in, so that msrun dying at any point
        # from then on (SIGKILL while it plans) leaves no cgroup behind
        self.entering: Entering | None = Entering(job_id, env, lambda cg: self.watchdog.tell(cg.watchdog_line()))
        self.cgroup: JobCgroup | None = None
        self.handed_off = False  # another process (the detached supervisor) owns the job now
        self.spare: set[int] = set()  # not part of the job although in its cgroup (the launcher)
        # Inside a Slurm job, the end of msrun's step (or batch script) SIGKILLs every process the
        # step left - the watchdog among them, often before it removed the empty cgroup; there
        # msrun leaves the cgroup and removes it itself (one more migration, ~ms, at its exit).
        self.remove_itself = "SLURM_JOB_ID" in env or "SLURM_JOBID" in env

    def ready(self) -> JobCgroup | None:
        """Wait until this process is inside the job's cgroup (before starting any process)."""
        if self.entering is not None:
            if self.entering.done.locked():
                timeline.mark("waiting to be in the job's cgroup")
            self.cgroup = self.entering.wait()
            timeline.mark("in the job's cgroup" if self.cgroup is not None else "no cgroup")
            self.entering = None
        return self.cgroup

    def describe(self) -> str:
        if self.cgroup is not None:
            return self.cgroup.describe()
        return f"no writable cgroup: processes carrying MSRUN_LAUNCHER_ID={self.job_id} are swept"

    def hand_off(self) -> None:
        """In the process that forked the detached supervisor: the supervisor owns the job (and the
        watchdog's pipe) now; this process lets go without telling the watchdog anything."""
        self.handed_off = True
        self.watchdog.let_go()
        if self.cgroup is not None:
            self.cgroup.leave()

    def kill_members(self) -> list[int]:
        """SIGKILL every other process in the job's cgroup (msrun lives there; the watchdog not)."""
        return self.cgroup.kill_others(self.spare) if self.cgroup is not None else []

    def release(self) -> None:
        """msrun is done (the job is over, or never started): nothing to kill; the watchdog
        removes the cgroup once msrun has exited."""
        if self.handed_off:
            return
        cgroup = self.ready()
        if (
            cgroup is not None
            and self.remove_itself
            and os.path.isdir(cgroup.path)
            and not any(p != os.getpid() for p in cgroup.members())
        ):
            cgroup.leave()
            cgroup.remove(timeout=1.0)
        self.watchdog.stand_down()
