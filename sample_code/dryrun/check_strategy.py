"""The same check as a plain script, for msrun directly:

    msrun --worker_num=4096 --local_worker_num=4096 --sim_level=1 --join=True \
        --sim_select=first:4,2045-2050,last:4,sample:16 sample_code/dryrun/check_strategy.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from strategy import check  # noqa: E402

if __name__ == "__main__":
    check(int(os.environ["RANK_ID"]), int(os.environ["RANK_SIZE"]))
