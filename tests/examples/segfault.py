import ctypes
import time

import pytest


@pytest.mark.msrun(worker_num=2)
def test_rank_segfaults(rank, msrun):
    msrun.barrier()  # both ranks are in the test before rank 1 crashes
    if rank == 1:
        print("rank 1 wrote this just before it crashed", flush=True)
        ctypes.string_at(0)
    time.sleep(30)  # the workload: rank 0 is still in its test when msrun stops it
