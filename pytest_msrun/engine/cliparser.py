"""msrun's flags for :mod:`argparse`: its help, its errors (in msrun's words), and every command
line :func:`pytest_msrun.engine.argv.parse_plain` declines. Imported only then: building an
argparse parser is a cost msrun's start does not otherwise pay."""

from __future__ import annotations

import argparse
import sys

from pytest_msrun.binding.flags import BindFlagError
from pytest_msrun.engine.argv import CONVERTERS
from pytest_msrun.engine.argv import UNSET as _UNSET
from pytest_msrun.engine.config import SCHEDULER_MODES

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import NoReturn


def _typed(name: str, errors: type[Exception]) -> Callable[[str], object]:
    """``--name``'s converter from :data:`~pytest_msrun.engine.argv.CONVERTERS` as an argparse
    ``type``: its ``errors`` become ``argument --name: <their message>``."""
    convert = CONVERTERS[name]

    def parse(value: str) -> object:
        try:
            return convert(value)
        except errors as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name
    return parse


class _Parser(argparse.ArgumentParser):
    """``usage: pmsrun`` (this command's name), but errors in MindSpore's words - ``msrun: error:``
    - so scripts that look for msrun's error lines find ours."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"msrun: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pmsrun",
        description="Start a distributed job: one scheduler plus N workers per node (MindSpore msrun compatible).",
    )
    p.set_defaults(**dict.fromkeys(CONVERTERS, _UNSET))  # every flag's, before any is added
    p.add_argument("--worker_num", type=int, help="total number of workers (ranks) (default 8)")
    p.add_argument("--local_worker_num", type=int, help="workers started on this node (default 8)")
    p.add_argument("--master_addr", help="scheduler address: IPv4, [IPv6] or host name (default 127.0.0.1)")
    p.add_argument("--master_port", type=int, help="scheduler port (default 8118; 0 = a free one, single node)")
    p.add_argument("--node_rank", type=int, help="this node's index (default -1: assign automatically)")
    p.add_argument("--log_dir", help="directory for scheduler.log and worker_<rank>.log (default: cwd)")
    p.add_argument(
        "--join",
        type=_typed("join", ValueError),
        metavar="{True,False}",
        help="wait for the job, tail logs and return its exit status (default False: detach)",
    )
    p.add_argument(
        "--cluster_time_out",
        type=int,
        help="seconds to wait for every node (default 600; negative: forever)",
    )
    p.add_argument("--bind_core", type=_typed("bind_core", BindFlagError), help="True, False or a JSON dict")
    p.add_argument(
        "--bind_numa",
        type=_typed("bind_numa", BindFlagError),
        help="True, False, a JSON dict or a JSON file",
    )
    p.add_argument("--sim_level", type=int, choices=[0, 1, 2, 3], help="dry-run simulation level")
    p.add_argument("--sim_rank_id", type=int, help="dry-run a single rank with this id")
    p.add_argument("--rank_table_file", help="rank table file (exported as RANK_TABLE_FILE)")
    p.add_argument("--worker_log_name", help="worker log prefix; {ip} and {hostname} are replaced")
    p.add_argument("--tail_worker_log", help="ranks whose logs are shown with --join=True (-1 = all)")
    p.add_argument(
        "--sim_select",
        help="dry run: the simulated ranks to run (N, A-B, first:K, last:K, sample:K[:SEED], mesh:D0xD1[x...]: "
        "a device mesh's seams; default all)",
    )
    p.add_argument("--sim_concurrency", type=int, help="dry run: simulated ranks running at once (0 = CPU count)")
    p.add_argument("--sim_budget", help="dry run: bytes a rank may hold (24GiB, 500MB); ranks over it fail")
    p.add_argument(
        "--scheduler",
        choices=SCHEDULER_MODES,
        help="the scheduler process: the builtin control plane (auto: plus a MindSpore scheduler when a MindSpore "
        "worker connects; mindspore: from the start), or the task itself (task, as MindSpore's msrun)",
    )
    p.add_argument("--print_plan", action="store_true", help="print the launch plan as JSON and start nothing")
    p.add_argument(
        "--dist_port",
        type=int,
        help="port exported as MASTER_PORT for torch env:// (default master_port+1)",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="write the job's timeline to FILE in the Chrome trace format (Perfetto); also MSRUN_TRACE=FILE",
    )
    p.add_argument("task_script", help="a .py script, python, python3, pytest, or another command")
    p.add_argument("task_script_args", nargs=argparse.REMAINDER, help="arguments passed to the task")
    return p
