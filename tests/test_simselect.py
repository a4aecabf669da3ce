"""``--sim_select``'s ``mesh:D0xD1[x...]`` against an oracle written apart from it."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_dryrun import RANK_TIMES

from pytest_msrun.engine.simselect import SelectionError, select_ranks


def coords(rank: int, dims: list[int]) -> tuple[int, ...]:
    """Row-major: the last dimension varies fastest (torch's init_device_mesh)."""
    out = []
    for d in reversed(dims):
        rank, c = divmod(rank, d)
        out.append(c)
    assert rank == 0
    return tuple(reversed(out))


def size(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


meshes = st.lists(st.integers(1, 40), min_size=1, max_size=4).filter(lambda dims: size(dims) <= 20000)


@given(meshes)
def test_a_mesh_selection_finds_every_seam(dims):
    world = size(dims)
    chosen = select_ranks("mesh:" + "x".join(map(str, dims)), range(world))
    assert chosen == sorted(set(chosen)) and all(0 <= r < world for r in chosen)
    assert len(chosen) <= max(dims) + 2 ** len(dims), "small: a diagonal and the corners"
    points = {coords(r, dims) for r in chosen}
    for i, d in enumerate(dims):
        assert {p[i] for p in points} == set(range(d)), f"every coordinate of dimension {i}"
        firsts = {p[:i] + p[i + 1 :] for p in points if p[i] == 0}
        lasts = {p[:i] + p[i + 1 :] for p in points if p[i] == d - 1}
        assert firsts & lasts, f"some group along dimension {i} runs its first and its last member"
    assert set(itertools.product(*[(0, d - 1) for d in dims])) <= points, "every corner"


@given(meshes, st.integers(1, 5), st.data())
def test_a_mesh_is_over_the_job_and_unions_with_other_items(dims, nodes, data):
    world = size(dims)
    text = "mesh:" + "x".join(map(str, dims))
    mesh = set(select_ranks(text, range(world)))
    assert select_ranks(f"{text},first:2,last:1", range(world)) == sorted(mesh | {0, min(1, world - 1), world - 1})
    lo = data.draw(st.integers(0, world - 1))
    hi = data.draw(st.integers(lo + 1, world))
    node = range(lo, hi)  # one node's share of the job
    assert select_ranks(text, node, world=world) == sorted(r for r in mesh if r in node)


def test_a_64x64_mesh():
    chosen = select_ranks("mesh:64x64", range(4096))
    assert 64 <= len(chosen) <= 68 and {0, 63, 4032, 4095} <= set(chosen)
    assert select_ranks("mesh:4x4,first:2", range(16)) == [0, 1, 3, 5, 10, 12, 15]
    assert select_ranks("mesh:16", range(16)) == list(range(16))


@pytest.mark.parametrize(
    "text,message",
    [
        ("mesh:64x32", "mesh:64x32 has 2048 ranks; this job has 4096"),
        ("mesh:4096x2", "has 8192 ranks"),
        *[
            (bad, "use mesh:D0xD1")
            for bad in [
                "mesh:",
                "mesh:0x4",
                "mesh:4x",
                "mesh:axb",
                "mesh:4x4x4x4x4x4x4x4x4",
                "mesh:4X4",
                "mesh:" + "9" * 5000,
            ]
        ],
        ("mesh", "mesh:D0xD1[x...]"),
        ("grid:4x4", "mesh:D0xD1[x...]"),
    ],
)
def test_bad_mesh_items(text, message):
    with pytest.raises(SelectionError) as err:
        select_ranks(text, range(4096))
    assert message in str(err.value)


def test_msrun_runs_exactly_the_mesh_ranks(msrun):
    msrun.script("ranks.py", RANK_TIMES)
    args = ["--worker_num=16", "--local_worker_num=16", "--sim_level=1", "--join=True", "--log_dir=logs", "ranks.py"]
    job = msrun.run([*args[:3], "--sim_select=mesh:4x4", *args[3:]], env={"HOLD": "0"})
    assert job.returncode == 0, job.stderr
    ran = sorted(json.loads(p.read_text())[0] for p in msrun.dump.glob("t_*.json"))
    assert ran == select_ranks("mesh:4x4", range(16)) == [0, 3, 5, 10, 12, 15]
    job = msrun.run([*args[:3], "--sim_select=mesh:4x3", *args[3:]])
    errors = [line for line in job.stderr.splitlines() if line.startswith("msrun: error:")]
    assert job.returncode == 2 and errors == [
        "msrun: error: argument --sim_select: mesh:4x3 has 12 ranks; this job has 16"
    ]
