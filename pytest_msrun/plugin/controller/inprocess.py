"""``--msrun-inprocess``: marked tests run in the pytest process, as rank 0 of a one-rank world.

For an IDE's debugger stepping through a test's code - not for a multi-rank failure, which a
one-rank world does not have (``--pdb`` reaches the ranks of a normal run: :mod:`.debugrank`).
During a marked test the process has the variables a one-rank msrun job gives its worker
(``RANK_ID=0``, ``RANK_SIZE=1``, ``LOCAL_RANK=0``, ``WORLD_SIZE=1``, a free ``MASTER_PORT`` for
torch ``env://``, ...) - but no scheduler, so ``pytest_msrun.control.cluster`` forms a local group
of one; afterwards the environment is restored exactly.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from pytest_msrun.engine import childenv
from pytest_msrun.netaddr import free_port
from pytest_msrun.plugin import envscope
from pytest_msrun.plugin.marker import MARKER


def one_rank_env() -> dict[str, str]:
    return {
        "RANK_SIZE": "1",
        "MS_WORKER_NUM": "1",
        "PYTHONUNBUFFERED": "1",
        **childenv.rank_vars(
            local_index=0,
            rank=0,
            world_size=1,
            local_world_size=1,
            node_index=0,
            node_count=1,
            master_ip="127.0.0.1",
            dist_port=free_port("127.0.0.1"),
        ),
    }


class InProcessPlugin:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        saved = envscope.apply(one_rank_env()) if item.get_closest_marker(MARKER) is not None else {}
        try:
            yield
        finally:
            envscope.revert(saved)

    def pytest_report_header(self, config: pytest.Config) -> str:
        return "msrun: --msrun-inprocess: marked tests run here as rank 0 of a one-rank world"
