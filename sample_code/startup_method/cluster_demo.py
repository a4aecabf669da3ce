"""A framework-free distributed job: every rank computes a share, the ranks combine them.

    msrun --worker_num=4 --local_worker_num=4 --master_port=0 --join=True --log_dir=msrun_log \
        sample_code/startup_method/cluster_demo.py
"""

from __future__ import annotations

import os
import socket

from pytest_msrun import cluster

N = int(os.environ.get("DEMO_N", "1000000"))


def main() -> None:
    cluster.init()
    rank, size = cluster.get_rank(), cluster.get_group_size()
    # Rank 0 decides the problem; everybody receives it.
    problem = cluster.broadcast_object({"n": N, "note": "sum of squares"} if rank == 0 else None, src=0)
    n = problem["n"]
    share = sum(i * i for i in range(rank, n, size))
    shares = cluster.all_gather_object({"rank": rank, "host": socket.gethostname(), "share": share})
    total = sum(s["share"] for s in shares)
    expected = (n - 1) * n * (2 * n - 1) // 6
    assert total == expected, (total, expected)
    cluster.barrier()
    print(f"rank {rank}/{size} (local {cluster.get_local_rank()}): share {share}, total {total} == {expected}")
    cluster.finalize()


if __name__ == "__main__":
    main()
