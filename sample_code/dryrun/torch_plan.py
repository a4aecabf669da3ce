"""A torch training strategy, as a training script has it: a stack of transformer blocks on a 2-D
device mesh (``dp`` x ``tp``), tensor parallel inside each block, FSDP2 across ``dp``, built on the
``meta`` device and trained with AdamW. Nothing here knows it is a dry run.

    pmsrun --worker_num=4096 --local_worker_num=4096 --sim_level=1 --sim_select=mesh:64x64 \\
        --sim_budget=20MiB --join=True --log_dir=dry sample_code/dryrun/torch_plan.py

``STRATEGY=indivisible`` asks for a tensor-parallel degree the world size does not divide;
``STRATEGY=replicated_head`` keeps the output head whole on the first rank of each tensor-parallel
group - those ranks go over the budget.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

DIM, HEADS, LAYERS, VOCAB = 512, 64, 4, 8_000
STRATEGY = os.environ.get("STRATEGY", "")
TP = 48 if STRATEGY == "indivisible" else 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model sharded for this rank, and its optimizer (parameters stay on ``meta``)."""
    dist.init_process_group()  # env:// - RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Model()
    plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {**plan, "w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    keep_head = STRATEGY == "replicated_head" and mesh["tp"].get_local_rank() == 0
    fully_shard(model, mesh=mesh["dp"], ignored_params=set(model.head.parameters()) if keep_head else None)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One training step on a tiny batch (parameters made real on the CPU first: local shards only)."""
    model.to_empty(device="cpu")
    tokens = torch.randint(0, VOCAB, (1, 16))
    model(tokens).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


if __name__ == "__main__":
    from pytest_msrun import dryrun

    model, optimizer = build()
    held = dryrun.account(model, optimizer)
    dryrun.collectives(lambda: step(model, optimizer))
    print(f"rank {dist.get_rank()}: {held}")
