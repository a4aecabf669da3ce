import pytest


@pytest.mark.xfail(reason="known bug on every rank")
@pytest.mark.msrun(worker_num=2)
def test_xfail_all_ranks(rank):
    raise AssertionError("fails as expected")


@pytest.mark.xfail(reason="rank 1 is known to fail")
@pytest.mark.msrun(worker_num=2)
def test_xfail_one_rank(rank):
    assert rank != 1


@pytest.mark.xfail(reason="expected to fail but passes")
@pytest.mark.msrun(worker_num=2)
def test_xpass(rank):
    pass


@pytest.mark.xfail(reason="strict", strict=True)
@pytest.mark.msrun(worker_num=2)
def test_xpass_strict(rank):
    pass
