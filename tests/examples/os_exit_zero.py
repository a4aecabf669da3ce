import os
import time

import pytest


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.msrun(worker_num=2)
def test_rank_exits_zero_mid_test(rank, msrun_tmp_path):
    if rank == 1:
        (msrun_tmp_path / "pid.tmp").write_text(str(os.getpid()))
        (msrun_tmp_path / "pid.tmp").rename(msrun_tmp_path / "pid1")
        os._exit(0)
    # rank 0 is still in its test when rank 1 exits: it waits for rank 1 to be gone
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pid = msrun_tmp_path / "pid1"
        if pid.exists() and gone(int(pid.read_text())):
            break
        time.sleep(0.02)
