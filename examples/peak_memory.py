"""Peak resident-memory growth of one attention forward and backward (it stays linear in L).

    python examples/peak_memory.py [L=32768] [causal|full] [auto|fused|tiled]

Prints the growth of the process's peak RSS after the forward and after the backward, beyond
the inputs (B=1, H=8, d=64, float32). The dense scores alone would be 32 GiB at L=32768.
"""

import resource
import sys
import time

import torch

import attnkit


def main() -> None:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    causal = (sys.argv[2] if len(sys.argv) > 2 else "causal") == "causal"
    backend = sys.argv[3] if len(sys.argv) > 3 else "auto"
    q, k, v = (torch.randn(1, 8, length, 64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 8, length, 64)

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    base = peak_mib()
    t0 = time.perf_counter()
    out = attnkit.attention(q, k, v, causal=causal, backend=backend)
    t1 = time.perf_counter()
    fwd = peak_mib()
    out.backward(dout)
    t2 = time.perf_counter()
    bwd = peak_mib()
    print(f"L={length} causal={causal} backend={backend}: peak +{fwd - base:.0f} MiB after "
          f"forward ({t1 - t0:.1f} s), +{bwd - base:.0f} MiB after backward ({t2 - t1:.1f} s)")


if __name__ == "__main__":
    main()
