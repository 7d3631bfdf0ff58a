"""Ring attention on CPU: a 2-rank causal forward and backward, checked against one process.

    torchrun --nproc_per_node 2 examples/ring_attention_demo.py

Every rank builds the same full q, k, v (same seed), keeps its zigzag shard, runs
``ring_attention`` forward and backward, and rank 0 gathers the shards and prints the largest
difference from single-process ``attnkit.attention`` on the full sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import attnkit
from attnkit.distributed import ring_attention, shard_sequence, unshard_sequence


def gather(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The full sequence from every rank's shard (on every rank)."""
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, x.contiguous())
    return unshard_sequence(shards, layout)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = "zigzag"  # balances causal work; "contiguous" works too

    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q = torch.randn(1, 8, 512, 64, generator=g)  # (batch, query heads, L, d)
    k = torch.randn(1, 2, 512, 64, generator=g)  # 2 key/value heads: GQA
    v = torch.randn(1, 2, 512, 64, generator=g)
    dout = torch.randn(1, 8, 512, 64, generator=g)

    qs, ks, vs = (shard_sequence(t, world, rank, layout).clone().requires_grad_(True)
                  for t in (q, k, v))
    out = ring_attention(qs, ks, vs, causal=True, layout=layout)  # (1, 8, 512 / world, 64)
    (out * shard_sequence(dout, world, rank, layout)).sum().backward()

    got = [gather(t, layout) for t in (out.detach(), qs.grad, ks.grad, vs.grad)]
    if rank == 0:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        ref_out = attnkit.attention(q, k, v, causal=True)
        ref = [ref_out.detach(), *torch.autograd.grad(ref_out, (q, k, v), dout)]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            print(f"{name}: max |ring - single process| = {(a - b).abs().max().item():.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
