"""One decoding step through each of attnkit's front doors, timed against torch SDPA.

    python examples/decode_paths.py [--batch 8] [--context 8192] [--dtype bfloat16]

Each sequence has ``context`` cached tokens (lengths vary by +-25% across the batch) and one
new query token; Hq=32 query heads share Hkv=8 key/value heads of dim 128. The same K/V is
given as a padded contiguous cache (``attention`` with ``seqlens_kv``), as packed sequences
(``varlen_attention``, continuous batching) and as a paged cache (``paged_attention``);
torch SDPA gets the padded cache with a boolean padding mask. Printed: median ms per step and
the K/V bytes read per second (real tokens only). Results are checked against each other.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit import native


def median_ms(fn, repeat: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d = args.batch, 32, 8, 128
    lens = (args.context * (0.75 + 0.5 * torch.rand(b, generator=g))).long().clamp(min=1)
    lmax = int(lens.max())
    k = torch.randn(b, hkv, lmax, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lmax, d, generator=g).to(dtype)
    q = torch.randn(b, hq, 1, d, generator=g).to(dtype)
    real_bytes = int(lens.sum()) * hkv * d * 2 * k.element_size()

    # packed (varlen) and paged copies of the same cache
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
    cu_q = torch.arange(b + 1, dtype=torch.int32)
    kp = torch.cat([k[i, :, : lens[i]].transpose(0, 1) for i in range(b)])
    vp = torch.cat([v[i, :, : lens[i]].transpose(0, 1) for i in range(b)])
    cache = attnkit.PagedKVCache(int((lens + 255).div(256, rounding_mode="floor").sum()), 256,
                                 hkv, d, dtype=dtype)
    for i in range(b):
        cache.allocate(i)
        cache.append(i, k[i, :, : lens[i]].transpose(0, 1), v[i, :, : lens[i]].transpose(0, 1))
    pad_mask = (torch.arange(lmax).view(1, 1, 1, -1) < lens.view(-1, 1, 1, 1))

    paths = {
        "attention (padded cache)": lambda: attnkit.attention(q, k, v, seqlens_kv=lens),
        "varlen_attention (packed)": lambda: attnkit.varlen_attention(
            q[:, :, 0], kp, vp, cu_q, cu_k).unsqueeze(2),
        "paged_attention (256-token pages)": lambda: attnkit.paged_attention(
            q, cache, list(range(b))),
        "torch SDPA (padded + mask)": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=pad_mask, enable_gqa=True),
    }
    ref = paths["torch SDPA (padded + mask)"]().float()
    print(f"B={b}, context ~{args.context} (lengths {lens.tolist()}), Hq={hq}, Hkv={hkv}, "
          f"d={d}, {args.dtype}; {native.describe()}")
    for name, fn in paths.items():
        err = (fn().float() - ref).abs().max().item()
        ms = median_ms(fn)
        print(f"  {name:36s} {ms:8.1f} ms  {real_bytes / ms / 1e6:6.1f} GB/s  "
              f"max diff vs SDPA {err:.1e}")


if __name__ == "__main__":
    main()
