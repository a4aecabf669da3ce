import os

import pytest


@pytest.mark.msrun(worker_num=4, sim_level=0)
def test_dry_run(rank, msrun):
    assert os.environ["MS_SIMULATION_LEVEL"] == "0" and "MS_ROLE" not in os.environ
    assert msrun.is_dryrun


@pytest.mark.msrun(worker_num=64, sim_level=1, sim_rank_id=37)
def test_one_simulated_rank(rank, world_size):
    assert rank == 37 and world_size == 64
