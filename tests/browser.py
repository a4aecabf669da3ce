"""Open a local HTML file in headless Chromium: the DOM after its scripts ran, a screenshot, and
the network requests it tried.

Chromium's proxy is a listening socket on 127.0.0.1 that only records and closes connections,
and ``--proxy-bypass-list=<-loopback>`` sends even loopback requests there: any request the
page makes (http, https, websocket, localhost) arrives as a recorded connection and fails.
The browser's own services would be recorded too, so they are switched off
(``--disable-sync``, the network time query, the optimization guide) or pointed at the closed port 127.0.0.1:1, the
one address the proxy is bypassed for (the component updater, the Google account endpoint):
on an empty page no connection arrives.

Chromium keeps its profile, cache, HOME, XDG dirs and TMPDIR under ``out_dir`` (TMPDIR in a
short /dev/shm directory, removed afterwards, where ``out_dir`` is too long a path for the
socket Chromium binds there), runs in a session of its own and is killed as a process group
afterwards, then anything still running with its profile: nothing is left in /tmp or running.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

NAMES = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT = 60.0
CLOSED = "127.0.0.1:1"  # nothing listens on port 1: the browser's own service URLs point here
# Chromium binds its singleton socket at $TMPDIR/org.chromium.Chromium.XXXXXX/SingletonSocket,
# and a socket path has at most 107 bytes: a TMPDIR longer than this aborts Chromium.
TMPDIR_MAX = 107 - len("/org.chromium.Chromium.XXXXXX/SingletonSocket")


def find_chromium() -> str | None:
    """The first of chromium, chromium-browser, google-chrome on PATH, or None."""
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class Page:
    dom: str  # the serialized DOM after scripts ran (--dump-dom)
    requests: int  # connections that reached the recording proxy: network requests tried
    lines: list[str] = field(default_factory=list)  # their first lines ("GET http://...", "CONNECT ...")
    screenshot: Path | None = None


class _RecordingProxy:
    """Accepts, records (the request line) and closes every connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port: int = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _record(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(1.0)
            try:
                head = conn.recv(4096)
            except OSError:
                head = b""
            self.lines.append(head.split(b"\r\n", 1)[0].decode("latin-1") or "(no request line)")

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self._record(conn)

    def close(self) -> list[str]:
        self._stop.set()
        self._thread.join(5)
        self.sock.setblocking(False)
        while True:  # connections still in the backlog count too
            try:
                conn, _ = self.sock.accept()
            except OSError:
                break
            self._record(conn)
        self.sock.close()
        return self.lines


@contextmanager
def _tmpdir(out_dir: Path) -> Iterator[Path]:
    """``out_dir``; where its path is too long for Chromium's socket, a short directory in
    /dev/shm (where Chromium keeps its shared memory anyway), removed afterwards."""
    if len(os.fsencode(out_dir)) <= TMPDIR_MAX:
        yield out_dir
        return
    short = Path(tempfile.mkdtemp(prefix="chromium-", dir="/dev/shm"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _env(out_dir: Path, tmp: Path) -> dict[str, str]:
    home, runtime = out_dir / "home", out_dir / "runtime"
    home.mkdir(parents=True, exist_ok=True)
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBUS_")}
    env.update(
        HOME=str(home),
        TMPDIR=str(tmp),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_RUNTIME_DIR=str(runtime),
    )
    return env


def _holding(profile: Path) -> list[psutil.Process]:
    """Live processes with ``profile`` on their command line."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
                str(profile) in a for a in proc.info["cmdline"] or ()
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _kill(proc: subprocess.Popen[str], profile: Path) -> None:
    """Kill Chromium's process group (zygotes, renderers, utilities), then anything still
    running with its profile; wait until they are gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for left in _holding(profile):
        try:
            left.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(_holding(profile), timeout=5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until init reaped the group's orphans
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)


def _command(chromium: str, headless: str, args: list[str], out_dir: Path, port: int) -> list[str]:
    profile = out_dir / "profile"
    return [
        chromium,
        headless,
        "--no-sandbox",  # the tests run as root
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        # the network time query and the optimization guide's hints and models (optimizationguide-pa)
        "--disable-features=NetworkTimeServiceQuerying,OptimizationHints,OptimizationHintsFetching,"
        "OptimizationGuideModelDownloading,OptimizationTargetPrediction",
        "--disable-dev-shm-usage",  # shared memory files under TMPDIR, not in a small /dev/shm
        "--disable-breakpad",
        "--no-first-run",
        "--no-default-browser-check",
        f"--user-data-dir={profile}",
        f"--disk-cache-dir={out_dir / 'cache'}",
        f"--crash-dumps-dir={out_dir / 'crash'}",
        f"--proxy-server=127.0.0.1:{port}",
        f"--proxy-bypass-list=<-loopback>;{CLOSED}",
        f"--component-updater=url-source=http://{CLOSED}/",
        f"--gaia-url=http://{CLOSED}/",
        *args,
    ]


def _run(chromium: str, headless: str, args: list[str], out_dir: Path, port: int) -> subprocess.CompletedProcess[str]:
    profile = out_dir / "profile"
    cmd = _command(chromium, headless, args, out_dir, port)
    with _tmpdir(out_dir) as tmp:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(out_dir, tmp),
            cwd=out_dir,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill(proc, profile)
            proc.communicate()
            raise
        finally:
            _kill(proc, profile)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _chromium(chromium: str, args: list[str], out_dir: Path, port: int) -> subprocess.CompletedProcess[str]:
    """Run with ``--headless=new``; with the old ``--headless`` where that mode is unknown."""
    done = _run(chromium, "--headless=new", args, out_dir, port)
    if done.returncode != 0 and "headless" in done.stderr.lower():
        done = _run(chromium, "--headless", args, out_dir, port)
    return done


def _prepare(html_path: Path, out_dir: Path) -> tuple[str, Path, str]:
    """Chromium's path (or an error saying none was found), the state directory, the page's URL."""
    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError(f"no Chromium on PATH (tried {', '.join(NAMES)})")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    return chromium, out_dir, Path(html_path).resolve().as_uri()


def open_page(html_path: Path, out_dir: Path, screenshot: Path | None = None) -> Page:
    """Load ``html_path`` in headless Chromium (state under ``out_dir``): the DOM after its
    scripts ran, and the requests it tried. With ``screenshot`` a second run saves a 1280x1600
    PNG there (its requests are counted too)."""
    chromium, out_dir, url = _prepare(html_path, out_dir)
    budget = "--virtual-time-budget=2000"
    proxy = _RecordingProxy()
    try:
        done = _chromium(chromium, [budget, "--dump-dom", url], out_dir, proxy.port)
        if done.returncode != 0 or "<html" not in done.stdout:
            raise RuntimeError(f"chromium failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        dom = done.stdout
        if screenshot is not None:
            shot = Path(screenshot).resolve()
            args = [budget, "--hide-scrollbars", "--window-size=1280,1600", f"--screenshot={shot}", url]
            done = _chromium(chromium, args, out_dir, proxy.port)
            if done.returncode != 0 or not shot.is_file():
                raise RuntimeError(f"chromium took no screenshot (exit {done.returncode}):\n{done.stderr[-3000:]}")
    finally:
        lines = proxy.close()
    return Page(dom=dom, requests=len(lines), lines=lines, screenshot=screenshot)


class _Pipe:
    """Chromium's DevTools protocol over ``--remote-debugging-pipe`` (fd 3 in, fd 4 out; JSON
    messages ending in NUL): commands and their answers, events skipped."""

    def __init__(self, send: int, receive: int) -> None:
        self.send, self.receive = send, receive
        self.buffer = b""
        self.next_id = 0

    def call(self, method: str, session: str | None = None, **params: object) -> dict:
        import json
        import select

        self.next_id += 1
        msg: dict[str, object] = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self.send, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT
        while True:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self.next_id:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.receive], [], [], left)[0]:
                raise RuntimeError(f"chromium did not answer {method} in {TIMEOUT:g} s")
            data = os.read(self.receive, 1 << 16)
            if not data:
                raise RuntimeError(f"chromium closed its DevTools pipe during {method}")
            self.buffer += data

    def evaluate(self, session: str, expression: str) -> object:
        result = self.call("Runtime.evaluate", session, expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")


def _high(fd: int) -> int:
    """``fd`` moved to a number above 9, so that placing the pipe on fds 3 and 4 overwrites neither."""
    import fcntl

    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


def type_into(html_path: Path, out_dir: Path, selector: str, text: str, probe: str) -> tuple[object, list[str]]:
    """Load ``html_path`` in headless Chromium, wait for its script (``body[data-ready]``), type
    ``text`` key by key into the element ``selector`` (focused, as a click would), then evaluate the
    JavaScript ``probe``: its value, and the network requests the page tried."""
    import json

    chromium, out_dir, url = _prepare(html_path, out_dir)
    child_in, to_child = (_high(fd) for fd in os.pipe())
    from_child, child_out = (_high(fd) for fd in os.pipe())

    def place() -> None:  # in the child: the protocol's fds 3 and 4 (dup2 makes them inheritable)
        os.dup2(child_in, 3)
        os.dup2(child_out, 4)

    proxy = _RecordingProxy()
    profile = out_dir / "profile"
    cmd = _command(chromium, "--headless=new", ["--remote-debugging-pipe", url], out_dir, proxy.port)
    try:
        with _tmpdir(out_dir) as tmp:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=_env(out_dir, tmp),
                cwd=out_dir,
                start_new_session=True,
                close_fds=False,
                preexec_fn=place,
            )
            os.close(child_in)
            os.close(child_out)
            child_in = child_out = -1
            try:
                pipe = _Pipe(to_child, from_child)
                deadline = time.monotonic() + TIMEOUT
                pages: list[dict] = []
                while not pages and time.monotonic() < deadline:  # the page's target may come a moment later
                    pages = [t for t in pipe.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
                if not pages:
                    raise RuntimeError("chromium opened no page")
                page = pages[0]
                session = str(pipe.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"])
                deadline = time.monotonic() + TIMEOUT
                while pipe.evaluate(session, "document.body && document.body.dataset.ready") != "1":
                    if time.monotonic() > deadline:
                        raise RuntimeError("the page's script did not run")
                    time.sleep(0.05)
                pipe.evaluate(session, f"document.querySelector({json.dumps(selector)}).focus()")
                for key in text:
                    pipe.call("Input.dispatchKeyEvent", session, type="keyDown", key=key, text=key)
                    pipe.call("Input.dispatchKeyEvent", session, type="keyUp", key=key)
                value = pipe.evaluate(session, probe)
            finally:
                _kill(proc, profile)
    finally:
        for fd in (child_in, child_out, to_child, from_child):
            if fd >= 0:
                os.close(fd)
        lines = proxy.close()
    return value, lines
