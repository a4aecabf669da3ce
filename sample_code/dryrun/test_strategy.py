"""Validate the sharding strategy for a 4096-rank job on a CI runner, without devices.

    python -m pytest sample_code/dryrun -q                  # passes
    STRATEGY=broken python -m pytest sample_code/dryrun -q  # fails, naming ranks 2047 and 4095

Each selected simulated rank runs this test in its own process with RANK_ID / RANK_SIZE of the
4096-rank job and MS_SIMULATION_LEVEL=1; the report merges them and lists the failing ranks.
"""

import pytest
from strategy import check

# The ranks worth simulating: both ends, the middle seam, and a reproducible random sample.
RANKS = "first:4,2045-2050,last:4,sample:16"


@pytest.mark.msrun(worker_num=4096, sim_level=1, sim_ranks=RANKS)
def test_shards_fit_and_tile(rank, world_size, msrun):
    assert msrun.is_dryrun and world_size == 4096
    check(rank, world_size)
