import pytest


@pytest.mark.msrun(worker_num=0)
def test_zero_ranks():
    pass


@pytest.mark.msrun(worker_num=2, colour="blue")
def test_unknown_argument():
    pass
