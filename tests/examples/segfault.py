import ctypes
import time

import pytest


@pytest.mark.msrun(worker_num=2)
def test_rank_segfaults(rank):
    if rank == 1:
        print("rank 1 wrote this just before it crashed", flush=True)
        time.sleep(0.2)
        ctypes.string_at(0)
    time.sleep(30)
