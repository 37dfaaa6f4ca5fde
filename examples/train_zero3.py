"""ZeRO-3 with infinity: every rank keeps, offloads and steps 1/N of every block.

    torchrun --nproc-per-node=2 examples/train_zero3.py                  # CPU, gloo
    torchrun --nproc-per-node=8 examples/train_zero3.py --nvme /mnt/nvme # GPUs, NCCL
    # two nodes, each with its own local NVMe (same path on both):
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=HOST:29500 \\
        examples/train_zero3.py --nvme /mnt/nvme --hybrid

Each rank loads its slice of the global batch; gradients are averaged across ranks, so the
result equals one process training on the whole global batch (within fp32 rounding).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import infinity


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))  # one block each
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme", default=None, help="a directory on this node's local NVMe")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--hybrid", action="store_true",
                    help="2-D mesh: shard within a node, replicate across nodes")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    group = None
    if args.hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        group = init_device_mesh("cuda" if cuda else "cpu", (world // per_node, per_node),
                                 mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # every rank builds the same initial model
    model = Model(vocab=512, width=256, layers=8)
    infinity.wrap(model, nvme_path=args.nvme, process_group=group,
                  param_tier="nvme" if args.nvme else "host")
    opt = infinity.optim.AdamW(model.parameters(), lr=3e-4)

    per_rank = args.global_batch // world
    gen = torch.Generator().manual_seed(1)
    device = "cuda" if cuda else "cpu"
    for step in range(args.steps):
        tokens = torch.randint(0, 512, (args.global_batch, 65), generator=gen)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank].to(device)
        logits = model(mine[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        opt.clip_grad_norm_(1.0)  # the norm is all-reduced over ranks
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step}: loss {avg.item() / world:.4f}", flush=True)

    state = infinity.sharding.full_state_dict(model)  # every rank calls; rank 0 gets it all
    if rank == 0:
        torch.save(state, "zero3_model.pt")
        tiers = infinity.stats(model)["tiers"]
        print("rank 0 holds", {k: v["now"] for k, v in tiers.items()}, "bytes per tier")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
