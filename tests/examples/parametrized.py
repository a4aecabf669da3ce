import pytest


@pytest.mark.msrun(worker_num=[1, 2, 4])
def test_sizes(world_size, msrun):
    assert msrun.world_size == world_size
    assert msrun.all_gather(msrun.rank) == list(range(world_size))


@pytest.mark.parametrize("x", [1, 2])
@pytest.mark.msrun(worker_num=2)
def test_with_user_params(x, rank):
    assert x in (1, 2)
