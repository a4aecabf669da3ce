import os

import pytest


@pytest.mark.msrun(worker_num=4, local_worker_num=2)
def test_two_nodes(rank, world_size, local_rank, msrun):
    assert world_size == 4 and local_rank == rank % 2
    assert os.environ["GROUP_RANK"] == str(rank // 2)
    assert msrun.all_gather(rank) == [0, 1, 2, 3]
