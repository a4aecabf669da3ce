import os

import pytest

if os.environ.get("RANK_ID") == "1":
    raise ImportError("rank 1 cannot import a dependency")


@pytest.mark.msrun(worker_num=2)
def test_needs_import(rank):
    pass
