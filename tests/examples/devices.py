import os

import pytest


@pytest.mark.msrun(worker_num=2, devices=2)
def test_gets_two_devices(rank):
    ids = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(ids) == 2


@pytest.mark.msrun(worker_num=2, devices=64)
def test_needs_too_many(rank):
    raise AssertionError("never runs")
