"""A file of twelve 2-rank gloo tests under each harness PyTorch users run, side by side.

    python bench/bench_torch_harnesses.py [--runs 5] [--tests 12]

The same twelve test bodies (a module-scoped process group, an all-reduce each), interleaved in a
shuffled order each round, each harness in its own directory with its own pytest cache (warmed by
one session first):

* ``pytest`` - the file marked ``@pytest.mark.msrun(worker_num=2)``: one warm world, the fork
  server's ranks forked with torch imported;
* ``torchrun -m pytest`` - ``torchrun --standalone --nproc-per-node=2 -m pytest`` on the unmarked
  file, once (two pytest sessions side by side: nothing isolated, each rank's verdict its own);
* ``torchrun per test`` - one ``torchrun ... -m pytest FILE::TEST`` per test (what CI scripts do to
  isolate tests);
* ``MultiProcessTestCase`` - torch's own harness (``torch.testing._internal``), where it imports
  (it needs ``expecttest``).

Medians over rounds with the 25th-75th percentile, and each harness over ``pytest``.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GLOO_GROUP, bench_env, interleaved, machine, quartiles, run_timed  # noqa: E402

BODY = (
    GLOO_GROUP
    + """


MARK
@pytest.mark.parametrize("i", range(N))
def test_all_reduce(group, i):
    t = torch.tensor([dist.get_rank() + 1.0 + i])
    dist.all_reduce(t)
    assert t.item() == 3 + 2 * i
"""
)
MPTC = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests


class AllReduce(MultiProcessTestCase):
    world_size = 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _group(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)

TESTS

if __name__ == "__main__":
    run_tests()
"""
TEST = """
    def test_all_reduce_{i}(self):
        self._group()
        t = torch.tensor([self.rank + 1.0 + {i}])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 3 + 2 * {i})
        dist.destroy_process_group()
"""


def _dir(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "test_gloo.py").write_text(text)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tests", type=int, default=12)
    args = parser.parse_args()
    n = args.tests
    torchrun = shutil.which("torchrun") or shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if importlib.util.find_spec("torch") is None or torchrun is None:
        raise SystemExit("torch is not installed: pip install torch==2.13.0 numpy")
    print(machine())
    with tempfile.TemporaryDirectory(prefix="bench-harnesses-") as tmp:
        root = Path(tmp)
        (root / "tmp").mkdir()
        env = bench_env(root, TMPDIR=str(root / "tmp"))  # (torchrun's and torch's own files: here, not in /tmp)
        body = BODY.replace("range(N)", f"range({n})")
        ours = _dir(root, "msrun", body.replace("MARK", "@pytest.mark.msrun(worker_num=2)"))
        plain = _dir(root, "torchrun", body.replace("MARK", ""))
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-o", "cache_dir=.cache"]
        launch = [torchrun, "--standalone", "--nproc-per-node=2", "-m", "pytest", "-q", "-p", "no:randomly"]
        contenders = {
            "pytest (msrun marker)": lambda _: run_timed([*pytest, "test_gloo.py"], env, cwd=ours),
            "torchrun -m pytest": lambda _: run_timed([*launch, "test_gloo.py"], env, cwd=plain),
            "torchrun per test": lambda _: sum(
                run_timed([*launch, f"test_gloo.py::test_all_reduce[{i}]"], env, cwd=plain) for i in range(n)
            ),
        }
        if importlib.util.find_spec("expecttest") is not None:
            mptc = _dir(root, "mptc", MPTC.replace("TESTS", "".join(TEST.format(i=i) for i in range(n))))
            contenders["MultiProcessTestCase"] = lambda _: run_timed([sys.executable, "test_gloo.py"], env, cwd=mptc)
        else:
            print("MultiProcessTestCase: expecttest is not installed - its row is left out")
        for run in contenders.values():  # each one's caches warm
            run(0)
        times = interleaved(args.runs, contenders)
    base = times["pytest (msrun marker)"]
    print(f"{n} two-rank gloo tests; {args.runs} rounds, interleaved; median [p25-p75]")
    for name, values in times.items():
        lo, mid, hi = quartiles(values)
        rlo, rmid, rhi = quartiles([v / b for v, b in zip(values, base)])
        print(f"{name:24} {mid:7.2f} s [{lo:.2f}-{hi:.2f}]   {rmid:5.2f}x [{rlo:.2f}-{rhi:.2f}] the msrun marker's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
