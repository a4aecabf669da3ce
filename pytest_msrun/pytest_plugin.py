"""pytest entry point (``pytest11``): the ``msrun`` marker.

The controller that turns a marked test into a multi-rank job is built on the launch engine;
until a test is marked, this plugin adds nothing but the marker's registration.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "msrun(worker_num=..., local_worker_num=..., timeout=..., bind_core=..., bind_numa=..., sim_level=..., "
        "scheduler=..., env=..., devices=...): run the test as a multi-rank msrun job",
    )
