"""Ports, settled before the plan is built: the scheduler's (claimed) and torch's ``MASTER_PORT``.

With the builtin control plane the scheduler port is bound here, by msrun itself, and handed to
the scheduler process: agents can register at once, a busy port is a usage error before anything
starts, and two jobs can never both pass a check and then collide. Another agent of a multi-node
job on this host may already hold it: this node then joins as a worker-only node - and while it
cannot reach a scheduler there, it tries to host one itself (``Starter.host_if_free``): the port may
have been held by something else for a moment, or lost by every node at once (two sockets that
enter ``listen`` together on Linux can both be refused), and then no node would host it.
"""

from __future__ import annotations

import _socket
import errno

from pytest_msrun.engine import console
from pytest_msrun.engine.config import LaunchConfig
from pytest_msrun.engine.kinds import SchedulerMode
from pytest_msrun.engine.plan import NodeFacts, effective_dist_port
from pytest_msrun.netaddr import format_hostport, free_port, listen_socket, port_is_free
from pytest_msrun.record import record, replace

EXIT_USAGE = 2


class LaunchError(Exception):
    """The job cannot start; nothing was left running."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@record
class Ports:
    facts: NodeFacts  # with the ports resolved (0 = a free one)
    hosts_scheduler: bool
    listener: _socket.socket | None = None  # the scheduler's, bound and listening
    contested: bool = False  # the port was taken on this host: this node may host it once free


def claim_again(facts: NodeFacts) -> _socket.socket | None:
    """The scheduler's port, listening, if it can be had now (a contested port: see :func:`claim`)."""
    try:
        return listen_socket(facts.master_ip, facts.master_port)
    except OSError:
        return None


def claim(cfg: LaunchConfig, facts: NodeFacts) -> Ports:
    hosts = facts.address_is_local and not cfg.dry_run
    port, dist = facts.master_port, facts.dist_port
    where = format_hostport(facts.master_ip, port)
    listener: _socket.socket | None = None
    contested = False
    if hosts and SchedulerMode(facts.scheduler_mode).has_control_plane:
        try:
            listener = listen_socket(facts.master_ip, port)
            port = int(listener.getsockname()[1])
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise LaunchError(f"--master_addr/--master_port: cannot listen on {where}: {exc}", EXIT_USAGE) from None
            if not cfg.multi_node:
                raise LaunchError(
                    f"--master_port: {where} is already in use (another job?); choose a free port or use "
                    "--master_port=0 to pick one",
                    EXIT_USAGE,
                ) from None
            hosts, contested = False, True
            console.info(f"{where} is taken on this host: joining as a worker node.")
    elif hosts:  # --scheduler=task: the task binds the port itself, as under MindSpore's msrun
        if port == 0:
            port = free_port(facts.master_ip)
        elif not port_is_free(facts.master_ip, port):
            raise LaunchError(
                f"--master_port: {where} is already in use; choose a free port or use --master_port=0", EXIT_USAGE
            )
    dist = effective_dist_port(facts.master_port and port, dist)
    if hosts and not cfg.multi_node and (dist == 0 or not port_is_free(facts.master_ip, dist)):
        dist = free_port(facts.master_ip, avoid=(port,))
    return Ports(replace(facts, master_port=port, dist_port=dist), hosts, listener, contested)
