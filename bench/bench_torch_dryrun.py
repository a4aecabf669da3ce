"""Dry runs of a torch plan: 8 sampled ranks of a 4096-rank TP + FSDP2 plan, against their floor.

    python bench/bench_torch_dryrun.py [--rounds 3]

Times, interleaved in a shuffled order each round: the floor - the same 8 ranks of
sample_code/dryrun/torch_plan.py one after another in ONE process, torch imported before the clock
starts (the fake process group and a CPU mesh made here; DTensor's caches cleared between ranks, as
a fresh process has them); ``python -m pytest_msrun --worker_num=4096 --local_worker_num=4096
--sim_level=1 --sim_select=<8 ranks> --join=True`` on the plan; the marked test
sample_code/dryrun/test_torch_plan.py; and the plan at 65536 ranks (8 sampled, dp=1024).
Target: 8 sampled ranks of a 4096-rank plan within 3x the floor, for pmsrun and the marked test.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, bench_env, interleaved, machine  # noqa: E402

PLAN = REPO / "sample_code" / "dryrun"
FLOOR = """
import sys, time
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor._redistribute import _gen_transform_infos
from torch.distributed.tensor.debug import CommDebugMode, _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore
import torch_plan
from pytest_msrun import dryrun

world, ranks = int(sys.argv[1]), [int(r) for r in sys.argv[2].split(",")]
init = dist.init_process_group
torch_plan.init_device_mesh = lambda _device, *a, **k: init_device_mesh("cpu", *a, **k)
t0 = time.perf_counter()
for r in ranks:
    torch_plan.dist.init_process_group = lambda r=r: init("fake", store=FakeStore(), rank=r, world_size=world)
    model, opt = torch_plan.build()
    torch_plan.dist.init_process_group = init
    held = dryrun.account(model, opt)
    assert held["mesh"]["coordinate"] == [r // 64, r % 64], (r, held)  # this rank's mesh, not a stale one
    dryrun.collectives(lambda: torch_plan.step(model, opt))
    dist.destroy_process_group()
    # DTensor caches shardings per mesh, and meshes of one shape compare equal across ranks
    _clear_sharding_prop_cache(), _gen_transform_infos.cache_clear(), MeshTopoInfo.build_from_mesh.cache_clear()
print("floor seconds", time.perf_counter() - t0)
"""


def sampled(world: int) -> str:
    """The mesh's corners, both ends of the first tensor-parallel group, the seam of data parallel."""
    return f"0,1,63,{world // 2 - 1},{world // 2},{world - 64},{world - 2},{world - 1}"


class Failed(Exception):
    """A measured command that did not exit 0."""


def timed(cmd: list[str], env: dict[str, str], out: Path) -> float:
    """Wall seconds of ``cmd`` (run in the checkout, its output to ``out``); :class:`Failed` unless it exits 0."""
    t0 = time.perf_counter()
    with out.open("w") as fh:
        rc = subprocess.run(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT).returncode
    took = time.perf_counter() - t0
    if rc:
        raise Failed(f"{' '.join(cmd[1:4])} ... exited {rc}:\n" + "\n".join(out.read_text().splitlines()[-15:]))
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "tmp").mkdir()  # torch's own caches (torchinductor_<user>) land here, not in /tmp
        env = bench_env(tmp, TMPDIR=str(tmp / "tmp"))  # bytecode cached in the scratch directory, not the checkout
        floor_env = {k: v for k, v in env.items() if not k.startswith(("MSRUN_SIM", "MS_SIMULATION"))}
        floor_env["PYTHONPATH"] = os.pathsep.join([str(PLAN), env["PYTHONPATH"]])  # no record, no budget
        (tmp / "floor.py").write_text(FLOOR)

        def pmsrun(world: int, ranks: str, i: int) -> list[str]:
            flags = f"--worker_num={world} --local_worker_num={world} --sim_level=1 --sim_select={ranks} --join=True"
            logs = tmp / f"logs{world}-{i}"
            return [py, "-m", "pytest_msrun", *flags.split(), f"--log_dir={logs}", str(PLAN / "torch_plan.py")]

        def floor(i: int) -> float:
            timed([py, str(tmp / "floor.py"), "4096", sampled(4096)], floor_env, tmp / "floor.out")
            lines = (tmp / "floor.out").read_text().splitlines()
            return float(next(x for x in lines if x.startswith("floor seconds")).split()[-1])

        scale = [65536]

        def at_scale(i: int) -> float:
            while scale[0] > 4096:
                try:
                    return timed(pmsrun(scale[0], sampled(scale[0]), i), env, tmp / "scale.out")
                except Failed as e:
                    print(f"!! pmsrun at {scale[0]} ranks FAILED, trying {scale[0] // 2}: {e}", flush=True)
                    scale[0] //= 2
            return float("nan")

        marked = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PLAN / "test_torch_plan.py")]
        try:  # untimed first: compile the bytecode every contender imports into the fresh cache
            timed(pmsrun(4096, "0", -1), env, tmp / "warm.out")
            timed([*marked, "--collect-only"], env, tmp / "warm.out")
            times = interleaved(
                args.rounds,
                {
                    "floor": floor,
                    "pmsrun": lambda i: timed(pmsrun(4096, sampled(4096), i), env, tmp / "pmsrun.out"),
                    "marked": lambda i: timed(marked, env, tmp / "marked.out"),
                    "scale": at_scale,
                },
            )
        except Failed as e:
            print(f"FAILED: {e}")
            return 1
    rows = {
        "floor": "floor: 8 ranks, one process",
        "pmsrun": "pmsrun, 4096 ranks (8 sampled)",
        "marked": "marked test, 4096 (8 sampled)",
        "scale": f"pmsrun, {scale[0]} ranks (8 sampled)" if scale[0] > 4096 else "pmsrun above 4096: none worked",
    }
    print(machine())
    cpus = len(os.sched_getaffinity(0))
    print(f"torch {importlib.metadata.version('torch')}, {cpus} CPUs (msrun runs at most {cpus} ranks at once)")
    print(f"{args.rounds} rounds; ranks at 4096: {sampled(4096)}; at {scale[0]}: {sampled(scale[0])}")
    print(f"{'what':36s} {'median s':>9s}  {'spread (min-max)':17s}  {'x floor, median [min-max]':26s} ranks/s")
    ratio: dict[str, float] = {}
    for name, label in rows.items():
        t = times[name]
        per_round = [a / b for a, b in zip(t, times["floor"])]  # each round against its own floor
        ratio[name] = statistics.median(per_round)
        x = f"{ratio[name]:5.2f}x [{min(per_round):.2f}-{max(per_round):.2f}]"
        med = statistics.median(t)
        print(f"{label:36s} {med:9.2f}  {min(t):7.2f}-{max(t):<9.2f}  {x:26s} {8 / med:7.2f}")
    met = ratio["pmsrun"] <= 3 and ratio["marked"] <= 3
    print(
        f"target: 8 sampled ranks of a 4096-rank TP + FSDP2 plan within 3x the floor: {'met' if met else 'NOT met'} "
        f"(pmsrun {ratio['pmsrun']:.1f}x, marked test {ratio['marked']:.1f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
