"""Pytest side of the labs: tier probes (``netns``, ``slurm``) and session fixtures.

Loaded by ``tests/conftest.py`` (``pytest_plugins``), which puts ``tests/lab`` on ``sys.path``.

- ``netlab2``: a :class:`netlab.NetLab` of two nodes (``node1``, ``node2``), up for the session.
- ``slurm_lab``: a :class:`slurmlab.SlurmLab` of two nodes; clients run with ``slurm_lab.env()``.
- ``user_lab``: a :class:`users.UserLab`: two throwaway local accounts, a victim and an attacker;
  ``victim_dir``: a new directory of the victim's for one test (every process of both accounts is
  killed when the test ends).

All are torn down (verified: no namespace, link, account, process or file left) at the end of the
session; a leak fails the teardown. Tests using them carry ``@pytest.mark.netns``,
``@pytest.mark.slurm`` or ``@pytest.mark.users``, which skip with the reason where the lab cannot
run (or fail under ``MSRUN_TEST_REQUIRE``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from netlab import NetLab, unusable_reason
from slurmlab import INSTALL_ENV, SlurmLab, install_requested, missing_commands
from users import UserLab
from users import unusable_reason as users_unusable_reason


@functools.cache
def netns_reason() -> str | None:
    """Why the ``netns`` tier cannot run here (not root, ip/nsenter/unshare missing, no namespaces)."""
    return unusable_reason()


@functools.cache
def slurm_reason() -> str | None:
    """Why the ``slurm`` tier cannot run here; None when it can (packages may still be installed
    by the fixture when ``MSRUN_LAB_INSTALL=1``)."""
    if os.geteuid() != 0:
        return "a Slurm lab needs root"
    missing = missing_commands()
    if missing and not install_requested():
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge, or set {INSTALL_ENV}=1)"
    return netns_reason()


@functools.cache
def users_reason() -> str | None:
    """Why the ``users`` tier cannot run here (not root, useradd/userdel or setpriv/runuser missing)."""
    return users_unusable_reason()


# tier -> probe returning a reason to skip, or None (tests/conftest.py applies them).
LAB_TIERS = {"netns": netns_reason, "slurm": slurm_reason, "users": users_reason}


@pytest.fixture(scope="session")
def netlab2() -> Iterator[NetLab]:
    """Two namespaced hosts, ``node1`` and ``node2``, on a private bridge (see tests/lab/netlab.py)."""
    reason = netns_reason()
    if reason:
        pytest.skip(reason)
    lab = NetLab(2).up()
    try:
        yield lab
    finally:
        lab.down()


@pytest.fixture(scope="session")
def slurm_lab() -> Iterator[SlurmLab]:
    """A two-node Slurm cluster (see tests/lab/slurmlab.py); run clients with ``env=slurm_lab.env()``."""
    reason = slurm_reason()
    if reason:
        pytest.skip(reason)
    lab = SlurmLab(2).up(install=install_requested())
    try:
        yield lab
    finally:
        lab.down()


@pytest.fixture(scope="session")
def user_lab() -> Iterator[UserLab]:
    """Two throwaway local accounts, ``user_lab.victim`` and ``user_lab.attacker`` (tests/lab/users.py)."""
    reason = users_reason()
    if reason:
        pytest.skip(reason)
    lab = UserLab().up()
    try:
        yield lab
    finally:
        lab.down()


@pytest.fixture
def victim_dir(user_lab: UserLab, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A new directory of the victim's (mode 0700, in its home) to run its commands in; when the
    test ends, every process of both accounts is killed (the attacker's first)."""
    import re
    import secrets

    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    path = user_lab.victim.mkdir(user_lab.victim.home / f"{name}-{secrets.token_hex(3)}")
    try:
        yield path
    finally:
        left = user_lab.attacker.kill_all() + user_lab.victim.kill_all()
        assert not left, f"processes of the test accounts survived SIGKILL: {left}"
