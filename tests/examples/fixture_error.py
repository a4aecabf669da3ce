import pytest


@pytest.fixture
def device(rank):
    if rank == 1:
        raise RuntimeError("no device for rank 1")
    return f"dev{rank}"


@pytest.mark.msrun(worker_num=2)
def test_uses_fixture(device):
    assert device
