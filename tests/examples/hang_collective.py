import time

import pytest


def compute():
    while True:
        time.sleep(0.1)


@pytest.mark.msrun(worker_num=4, timeout=10)
def test_stuck(rank, msrun):
    msrun.barrier()
    if rank == 3:
        compute()
    msrun.barrier()
