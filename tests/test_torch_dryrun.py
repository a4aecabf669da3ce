"""torch strategies in dry runs: unchanged code at thousands of ranks, rank by rank.

A simulated rank's ``init_process_group()`` is torch's fake process group and its meshes are CPU
meshes (``control/torchdry.py``); what a rank records must be what the same rank computes when
the plan is run by hand against torch's fake backend in one process (``ORACLE``, torchtitan's way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def own_tmpdir(tmp_path_factory, monkeypatch):
    """torch writes its caches under the temp directory (DDP: ``torchinductor_<user>``): the test's own."""
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))


PLAN = REPO / "sample_code" / "dryrun" / "torch_plan.py"
RANKS = [0, 1, 63, 2047, 2048, 4032, 4094, 4095]

# A rank by hand: torch's fake backend and a CPU mesh, set up by this script (torchtitan's way).
ORACLE = """
import json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, sys.argv[1])
import torch_plan
from pytest_msrun import dryrun
world, rank = int(sys.argv[2]), int(sys.argv[3])
init, make_mesh = dist.init_process_group, torch_plan.init_device_mesh
torch_plan.init_device_mesh = lambda _kind, shape, **kw: make_mesh("cpu", shape, **kw)
dist.init_process_group = lambda: init("fake", store=FakeStore(), rank=rank, world_size=world)
model, opt = torch_plan.build()
held = dryrun.account(model, opt)
held["collectives"] = dryrun.collectives(lambda: torch_plan.step(model, opt))
print(json.dumps({rank: held}))
"""


def by_hand(world: int, rank: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Rank ``rank`` of the plan by hand, in a process of its own (torch's meshes keep state per
    process: a second rank in the same process would see the first one's coordinates)."""
    command = [sys.executable, "-c", ORACLE, str(PLAN.parent), str(world), str(rank)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def oracle(world: int, ranks: list[int]) -> dict[int, dict]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda r: by_hand(world, r), ranks))
    assert all(p.returncode == 0 for p in done), [p.stderr[-2000:] for p in done]
    return {int(r): v for p in done for r, v in json.loads(p.stdout.splitlines()[-1]).items()}


def dry(msrun, ranks: list[int], *extra: str, env: dict[str, str] | None = None, world: int = 4096):
    args = [f"--worker_num={world}", f"--local_worker_num={world}", "--sim_level=1"]
    args += [f"--sim_select={','.join(map(str, ranks))}", "--join=True", "--log_dir=logs", *extra, str(PLAN)]
    return msrun.run(args, env=env or {}, timeout=600)


def records(job, ranks: list[int]) -> dict[int, dict]:
    return {r: json.loads((job.log_dir / f"worker_{r}.sim.json").read_text()) for r in ranks}


def test_the_sample_plan_validates_at_4096_ranks_each_rank_its_own_shards(msrun):
    """Unchanged plan code (init_process_group() from env://, a "cuda" mesh on a CPU build): each
    selected rank holds what the same rank holds by hand, and the summary sets them side by side."""
    job = dry(msrun, RANKS, "--sim_budget=4MiB")
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    got = records(job, RANKS)
    expected = oracle(4096, RANKS)
    for rank in RANKS:
        assert got[rank] == {**expected[rank], "rank": rank}, rank
        assert got[rank]["mesh"]["coordinate"] == [rank // 64, rank % 64]
        assert got[rank]["collectives"]["reduce_scatter"][0] > 0
    assert len({got[r]["params"] for r in RANKS}) > 1, "the seam: data-parallel ranks past 8 hold less"
    table = job.stdout[job.stdout.index("what each simulated rank holds") :]
    rows = [line.split() for line in table.splitlines()[2:10]]
    assert [int(row[0]) for row in rows] == RANKS and all(
        row[1] == f"{r // 64},{r % 64}" for row, r in zip(rows, RANKS)
    )
    assert "8 of 4096 ranks: most rank 0" in table and "budget 4.0 MiB" in table


def test_ranks_over_the_budget_fail_naming_what_they_hold(msrun):
    """The head kept whole on each tensor-parallel group's first rank: exactly those ranks fail."""
    job = dry(msrun, RANKS, "--sim_budget=4MiB", env={"STRATEGY": "replicated_head"})
    over = [r for r in RANKS if r % 64 == 0]
    assert job.returncode == 1, job.stdout[-3000:]
    assert f"failed: {','.join(map(str, over))}" in job.stdout
    for rank in over:
        assert f"OverBudget: rank {rank} at ({rank // 64}, 0) of mesh ('dp', 'tp') holds " in job.stdout
    assert "> budget 4.0 MiB (--sim_budget / sim_budget=): params " in job.stdout


def test_a_tensor_parallel_degree_the_world_does_not_divide_fails_every_rank_as_torch_would(msrun):
    job = dry(msrun, [0, 4095], env={"STRATEGY": "indivisible"})
    assert job.returncode == 1 and "failed: 0,4095" in job.stdout, job.stdout[-3000:]
    for rank in (0, 4095):
        alone = by_hand(4096, rank, {**os.environ, "STRATEGY": "indivisible"})
        reason = alone.stderr.strip().splitlines()[-1]  # the same error, run by hand
        assert alone.returncode != 0 and reason in job.stdout, (reason, job.stdout[-3000:])


def test_peers_and_devices_a_dry_run_does_not_have(msrun):
    """Any backend, env:// or explicit, a device_id, a "cuda" or "npu" mesh: no peers, no devices."""
    msrun.script(
        "plan.py",
        """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh, DeviceMesh
dist.init_process_group(backend=os.environ["BACKEND"], device_id=torch.device("cuda", 0))
assert (dist.get_rank(), dist.get_world_size()) == (int(os.environ["RANK"]), 65536)
mesh = init_device_mesh("cuda", (256, 256), mesh_dim_names=("dp", "tp"))
assert mesh.device_type == "cpu" and list(mesh.get_coordinate()) == [dist.get_rank() // 256, dist.get_rank() % 256]
assert DeviceMesh("npu", torch.arange(65536)).device_type == "cpu"
t = torch.ones(4)
dist.all_reduce(t)  # returns: no peers to wait for
print("rank", dist.get_rank(), "ok", os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"])
""",
    )
    for backend in ("nccl", "gloo"):
        job = msrun.run(
            ["--worker_num=65536", "--local_worker_num=65536", "--sim_level=3", "--sim_select=0,65535"]
            + ["--join=True", "--log_dir=logs", "plan.py"],
            env={"BACKEND": backend},
            timeout=300,
        )
        assert job.returncode == 0, job.stdout[-3000:]
        assert "rank 0 ok 0 65536" in job.stdout and "rank 65535 ok 65535 65536" in job.stdout


def sample(pytester) -> None:
    for name in ("torch_plan.py", "test_torch_plan.py", "conftest.py"):
        pytester.path.joinpath(name).write_text((PLAN.parent / name).read_text())


def test_a_marked_test_reports_the_ranks_side_by_side(pytester):
    sample(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", timeout=600)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*msrun dry run: what each simulated rank holds*",
            "rank  mesh (dp,tp) *",
            "4095  63,63 *",
            "8 of 4096 ranks:*",
        ]
    )


def test_a_marked_test_over_budget_fails_naming_the_ranks(pytester, monkeypatch):
    sample(pytester)
    monkeypatch.setenv("STRATEGY", "replicated_head")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=600)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]rank 0[]] failed first; also failed on ranks 2048, 4032*"])
    result.stdout.fnmatch_lines(["*OverBudget: rank 0 at (0, 0) of mesh ('dp', 'tp') holds *"])


STRATEGIES = {
    "ddp": """
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(nn.Linear(256, 256))
sent = dryrun.collectives(lambda: model(torch.randn(2, 256)).sum().backward())
assert sent["all_reduce"][0] >= 1 and sent["all_reduce"][1] >= (256 * 256 + 256) * 4, sent
assert model.module.weight.grad.shape == (256, 256)
""",
    "hsdp": """
from torch.distributed.fsdp import fully_shard
mesh = init_device_mesh("cuda", (w // 8, 8), mesh_dim_names=("replicate", "shard"))
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
fully_shard(model, mesh=mesh)
assert [p.to_local().shape[0] for p in model.parameters()] == [8, 8]  # 64 rows over the 8 of "shard"
""",
    "3d": """
mesh = init_device_mesh("cuda", (4, w // 16, 4), mesh_dim_names=("pp", "dp", "tp"))
assert list(mesh.get_coordinate()) == [r // (w // 4), (r // 4) % (w // 16), r % 4]
group = dist.new_group(list(range(r % 2, w, 2)))
t = torch.ones(3)
dist.all_reduce(t, group=group)
dist.barrier()
""",
    "default_group": """
mesh = init_device_mesh("cuda", (32, 32))  # the default group made by torch itself, from env://
assert (dist.get_rank(), dist.get_world_size()) == (int(os.environ["RANK"]), 1024)
assert list(mesh.get_coordinate()) == [dist.get_rank() // 32, dist.get_rank() % 32]
r = dist.get_rank()
""",
    "positional": """
dist.init_process_group("nccl", "env://", None, 1024, int(os.environ["RANK"]))  # torch's positional order
r = dist.get_rank()
""",
    "objects": """
box = [{"lr": 1e-3}] if r == 0 else [None]
dist.broadcast_object_list(box, src=0)
""",
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_other_strategies_pass_or_fail_as_on_a_cluster(msrun, strategy):
    """DDP (its all-reduce issued and counted), HSDP, a 3-D mesh and sub-groups, a default group
    torch makes itself, init_process_group's positional form run; an object collective, whose peers
    a simulated rank has not, fails at once with why."""
    head = "import os, torch, torch.nn as nn, torch.distributed as dist\nfrom torch.distributed.device_mesh import "
    head += "init_device_mesh\nfrom pytest_msrun import dryrun\n"
    if strategy not in ("default_group", "positional"):
        head += "dist.init_process_group()\nr, w = dist.get_rank(), dist.get_world_size()\n"
    msrun.script("plan.py", head + STRATEGIES[strategy] + "print('done', r)\n")
    job = msrun.run(
        ["--worker_num=1024", "--local_worker_num=1024", "--sim_level=1", "--sim_select=0,5,1023"]
        + ["--join=True", "--log_dir=logs", "plan.py"],
        timeout=300,
    )
    if strategy == "objects":
        assert job.returncode == 1 and "failed: 0,5,1023" in job.stdout, job.stdout[-3000:]
        assert (
            "torch.distributed.broadcast_object_list in a dry run (MS_SIMULATION_LEVEL): each simulated rank"
            in job.stdout
        )
    else:
        assert job.returncode == 0, job.stdout[-3000:]
        assert all(f"done {r}" in job.stdout for r in (0, 5, 1023))


PROBE = """
import json, os, sys

before = "torch" in sys.modules  # what the rank started with
import torch

with open(os.path.join(os.environ["OUT"], f"rank{os.environ['RANK']}.json"), "w") as fh:
    json.dump({"before": before, "threads": torch.get_num_threads(), "argv": sys.argv, "path0": sys.path[0]}, fh)
"""


def test_pmsrun_forks_the_simulated_ranks_of_a_torch_task_once_it_imported_torch(msrun):
    """More ranks than run at once: msrun imports the task's torch modules once (the fork server's
    rule) and forks each rank, which starts with torch imported; ranks that all run at once start
    as new processes. Both see what a fresh ``python SCRIPT`` sees."""
    script = msrun.script("probe.py", PROBE)
    seen = {}
    for concurrency, out in ((1, "forked"), (3, "spawned")):
        (msrun.cwd / out).mkdir()
        args = ["--worker_num=64", "--local_worker_num=64", "--sim_level=1", "--sim_select=0,1,63"]
        args += [f"--sim_concurrency={concurrency}", "--join=True", f"--log_dir={out}-logs", str(script), "x"]
        job = msrun.run(args, env={"OUT": str(msrun.cwd / out)}, timeout=300)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "new processes" not in job.stdout + job.stderr
        seen[out] = {r: json.loads((msrun.cwd / out / f"rank{r}.json").read_text()) for r in (0, 1, 63)}
    cpus = len(os.sched_getaffinity(0))
    for rank in (0, 1, 63):
        forked, spawned = seen["forked"][rank], seen["spawned"][rank]
        assert forked.pop("before") and not spawned.pop("before"), (forked, spawned)
        # each rank's share of the CPUs: all of them, one rank at a time; else CPUs / 3 (at least one)
        assert (forked.pop("threads"), spawned.pop("threads")) == (cpus, max(1, cpus // 3))
        assert forked == spawned, rank  # sys.argv, sys.path[0]
