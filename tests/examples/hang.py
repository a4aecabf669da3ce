import time

import pytest


def wait_forever_here():
    while True:
        time.sleep(0.1)


@pytest.mark.msrun(worker_num=2, timeout=10)
def test_hangs(rank):
    wait_forever_here()
