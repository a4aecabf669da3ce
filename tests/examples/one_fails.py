import pytest


@pytest.mark.msrun(worker_num=3)
def test_rank_one_fails(rank):
    value = rank * 10
    assert value != 10, f"rank {rank} computed the wrong value"
