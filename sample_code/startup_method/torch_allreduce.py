"""A torch.distributed ``gloo`` all-reduce under msrun: env:// works unchanged.

msrun exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (a port distinct from
the scheduler's), so ``init_process_group`` needs no arguments:

    msrun --worker_num=2 --local_worker_num=2 --master_port=0 --join=True \
        sample_code/startup_method/torch_allreduce.py
"""

import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK_ID"]) and world == int(os.environ["RANK_SIZE"])
    tensor = torch.tensor([float(rank + 1), 1.0])
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    expected = world * (world + 1) / 2
    assert tensor.tolist() == [expected, float(world)], tensor
    print(f"rank {rank}/{world}: all_reduce -> {tensor.tolist()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
