import pytest


@pytest.mark.msrun(worker_num=2)
def test_all_skip(rank):
    pytest.skip("not on this platform")


@pytest.mark.msrun(worker_num=3)
def test_one_rank_skips(rank):
    if rank == 2:
        pytest.skip("rank 2 has no device")


@pytest.mark.skipif(True, reason="statically skipped")
@pytest.mark.msrun(worker_num=2)
def test_static_skip(rank):
    raise AssertionError("never runs")
