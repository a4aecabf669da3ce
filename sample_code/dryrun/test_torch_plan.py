"""Validate a torch training strategy (torch_plan.py: 2-D mesh, tensor parallel + FSDP2) for a
4096-rank job on a CI runner, without devices:

    python -m pytest sample_code/dryrun/test_torch_plan.py -q                           # passes
    STRATEGY=replicated_head python -m pytest sample_code/dryrun/test_torch_plan.py -q  # 0, 2048, 4032 over budget
    STRATEGY=indivisible python -m pytest sample_code/dryrun/test_torch_plan.py -q      # every rank fails

Each selected simulated rank runs the unchanged plan against torch's fake process group, sees its
own shards and records what it holds and what one step sends; the report puts them side by side.
"""

import pytest

torch = pytest.importorskip("torch")

from torch_plan import build, step  # noqa: E402

from pytest_msrun import dryrun  # noqa: E402

# The mesh's corners, both ends of the first tensor-parallel group, the middle seam of data parallel;
# sim_ranks="mesh:64x64" covers every coordinate of both dims (66 ranks).
RANKS = "0,1,63,2047,2048,4032,4094,4095"


@pytest.mark.msrun(worker_num=4096, sim_level=1, sim_ranks=RANKS, sim_budget="4MiB")
def test_plan_fits_and_steps_at_4096_ranks(rank, world_size):
    model, optimizer = build()
    held = dryrun.account(model, optimizer)  # fails the rank past the budget, naming what it holds
    assert held["mesh"]["coordinate"] == [rank // 64, rank % 64]
    sent = dryrun.collectives(lambda: step(model, optimizer))
    assert sent["reduce_scatter"][0] > 0 and sent["all_gather"][0] > 0  # FSDP2 gathers and reduces
