import json

import pytest


@pytest.mark.msrun(worker_num=3, env={"MY_SETTING": "42"})
def test_shared_dir_and_context(msrun, msrun_tmp_path):
    assert msrun.env["RANK_ID"] == str(msrun.rank)
    assert msrun.log_dir is not None and (msrun.log_dir / f"worker_{msrun.rank}.log").exists()
    import os

    assert os.environ["MY_SETTING"] == "42"
    (msrun_tmp_path / f"rank{msrun.rank}.json").write_text(json.dumps(msrun.rank))
    msrun.barrier()
    assert sorted(p.name for p in msrun_tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json", "rank2.json"]
    assert msrun.broadcast("from-2" if msrun.rank == 2 else None, src=2) == "from-2"
