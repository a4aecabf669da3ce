import os

import pytest


@pytest.mark.msrun(worker_num=2, bind_core=True)
def test_each_rank_on_its_own_cpu(rank):
    assert os.sched_getaffinity(0) == {rank}
    assert os.environ["MSRUN_CPU_LIST"] == f"[{rank}]"


@pytest.mark.msrun(worker_num=2, bind_core={"device0": ["1"], "device1": ["0"]})
def test_custom_dict(rank):
    assert os.sched_getaffinity(0) == {1 - rank}
