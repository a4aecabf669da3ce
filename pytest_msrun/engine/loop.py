"""One event loop for an agent: child exits (pidfds), signals to msrun, the control-plane link.

Exits are seen the moment they happen - a pidfd per child, or SIGCHLD where pidfds are missing -
never by polling (``epoll`` directly: :mod:`selectors` is a cost on msrun's start path). Events
come out typed and ordered: messages from the control plane first (an
abort the scheduler sent before it exited explains that exit), then exits in the order the
kernel reported them.
"""

from __future__ import annotations

import os
import select
import signal
from enum import Enum

from pytest_msrun.control import wire
from pytest_msrun.engine import heldsignals, suppress
from pytest_msrun.engine.processes import Child
from pytest_msrun.record import field, record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from pytest_msrun.engine.link import ControlLink


class EventKind(Enum):
    EXITED = "exited"  # a child ended
    SIGNALLED = "signalled"  # msrun got SIGINT, SIGTERM or SIGHUP
    MESSAGE = "message"  # the control plane said something
    LINK_CLOSED = "link closed"  # the control plane's connection ended


@record
class Event:
    kind: EventKind
    child: Child | None = None
    message: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


class EventLoop:
    """Use as a context manager: it installs msrun's signal handlers and restores them after."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.sources: dict[int, Any] = {}  # fd -> "signal", "link" or the Child whose pidfd it is
        self.signal_received: int | None = None
        self.children: list[Child] = []  # watched without a pidfd (SIGCHLD)
        self.link: ControlLink | None = None
        self._wake_r = self._wake_w = -1
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1

    def __enter__(self) -> EventLoop:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (*heldsignals.HELD, signal.SIGCHLD):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._register(self._wake_r, "signal")
        heldsignals.let_in()  # one that came while msrun started is answered now
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old_handlers.items():
            with suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        with suppress(ValueError):
            signal.set_wakeup_fd(self._old_wakeup)
        for fd in (self._wake_r, self._wake_w):
            with suppress(OSError):
                os.close(fd)
        self.epoll.close()

    def _register(self, fd: int, source: Any) -> None:
        self.epoll.register(fd, select.EPOLLIN)
        self.sources[fd] = source

    def _unregister(self, fd: int) -> None:
        if self.sources.pop(fd, None) is not None:
            with suppress(ValueError, OSError):  # closed meanwhile
                self.epoll.unregister(fd)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum != signal.SIGCHLD and self.signal_received is None:
            self.signal_received = signum

    # ------------------------------------------------------------------ sources
    def watch(self, child: Child) -> None:
        """Report ``child``'s exit as an event."""
        if child.pidfd is not None:
            self._register(child.pidfd, child)
            return
        self.children.append(child)
        child.reap()  # it may have exited before SIGCHLD could be watched for

    def attach(self, link: ControlLink) -> None:
        self.link = link
        self._register(link.fileno(), "link")

    # ------------------------------------------------------------------ waiting
    def poll(self, timeout: float | None) -> list[Event]:
        """Wait up to ``timeout`` seconds (None: until something happens) and return what happened."""
        events: list[Event] = []
        # Messages the link already read (its handshake's read can take the next message with
        # the welcome) are read now: the socket may never be readable again to announce them.
        buffered = self.link is not None and self.link.buffered()
        wait = 0 if buffered else (-1 if timeout is None else timeout)
        ready = [(fd, self.sources.get(fd)) for fd, _ in self.epoll.poll(wait)]
        if buffered and not any(source == "link" for _, source in ready):
            events.extend(self._read_link())
        for fd, source in ready:
            if source == "signal":
                with suppress(OSError):
                    while os.read(self._wake_r, 512):
                        pass
                exited = [c for c in self.children if c.alive and c.reap()]
                events.extend(Event(EventKind.EXITED, child=c) for c in exited)
            elif source == "link":
                events.extend(self._read_link())
            elif isinstance(source, Child):
                self._unregister(fd)
                if source.reap():
                    events.append(Event(EventKind.EXITED, child=source))
        if self.signal_received is not None:
            events.append(Event(EventKind.SIGNALLED))  # which one: signal_received
        events.sort(key=lambda e: e.kind is not EventKind.MESSAGE)
        return events

    def _read_link(self) -> list[Event]:
        assert self.link is not None
        try:
            messages = self.link.read()
        except (wire.PeerClosed, OSError, wire.ProtocolError) as exc:
            for fd in [fd for fd, source in self.sources.items() if source == "link"]:
                self._unregister(fd)
            self.link = None
            return [Event(EventKind.LINK_CLOSED, reason=str(exc))]
        return [Event(EventKind.MESSAGE, message=m) for m in messages]
