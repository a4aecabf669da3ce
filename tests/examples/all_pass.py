import pytest


@pytest.mark.msrun(worker_num=3)
def test_all_ranks_pass(rank, world_size, local_rank):
    assert world_size == 3 and 0 <= rank < 3 and local_rank == rank
    print(f"output of rank {rank}")
