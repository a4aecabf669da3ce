import pytest


@pytest.mark.msrun(worker_num=2)
def test_first(rank):
    assert rank == 5


@pytest.mark.msrun(worker_num=2)
def test_second(rank):
    assert rank == 5


def test_third():
    raise AssertionError("fails as expected")
