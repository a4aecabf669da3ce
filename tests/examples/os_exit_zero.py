import os
import time

import pytest


@pytest.mark.msrun(worker_num=2)
def test_rank_exits_zero_mid_test(rank):
    if rank == 1:
        os._exit(0)
    time.sleep(0.3)
