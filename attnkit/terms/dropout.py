"""Counter-based random numbers for replayable attention dropout.

Dropout inside a tiled attention kernel must give every attention weight ``(b, h, i, j)`` the
same keep/drop decision in the forward pass, in the backward pass and in any other tiling of
the score matrix. A counter-based generator does this without storing a mask: the random for a
weight is a pure function of ``(seed, offset, b, h, i, j)``. This module implements
Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the
generator behind cuRAND, cuDNN and PyTorch's CUDA dropout) with plain int64 tensor ops, so it
runs on any device and any tile shape gives bitwise the same values.

Counter layout (four 32-bit words), key and output word::

    counter = (c0, c1, c2, c3) = (16 * (j // 64) + j % 16, i, h + b * 2**16, offset)
    key     = (k0, k1)         = (seed mod 2**32, seed // 2**32)
    word    = (j // 16) % 4    of the call's four output words

    b       absolute batch (sequence) index        0 <= b < 2**16
    h       absolute query-head index               0 <= h < 2**16
    i       absolute query row                      0 <= i < 2**32
    j       absolute key column                     0 <= j < 2**32
    offset  stream number                           0 <= offset < 2**32
    seed    64-bit key                              0 <= seed < 2**64

One Philox call serves four keys of a row: keys ``64 q + 16 w + n`` (``0 <= n < 16``) take
word ``w`` of the call with ``c0 = 16 q + n``. So a run of 16 consecutive keys takes one word
each of 16 consecutive calls, which is how a 16-lane vector kernel draws the keep mask of a
64-key block with 16 calls instead of 64. Every coordinate has its own bits and every key its
own (call, word) pair, so no two weights of one call share a random, and calls that differ in
``seed`` (the key) or ``offset`` (a counter word) never do. ``offset``
selects an independent stream for the same seed (use a fresh seed per call, or one seed and
``offset`` = call number, e.g. the layer index); it is *not* a count of randoms consumed as in
PyTorch's CUDA generator, and there is no need to advance it by the size of a call.

From the chosen output word ``x``: ``uniform = (x >> 8) * 2**-24``, a float32 on
the 2**-24 grid in [0, 1). A weight is kept when ``uniform >= p`` (exactly, in real
arithmetic), and kept weights are scaled by ``1 / (1 - p)``.

Shape legend: ``b, h, i, j`` are integer tensors (or Python ints) that broadcast against each
other, e.g. ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``i (1, 1, Lq, 1)``, ``j (1, 1, 1, Lk)``
give a ``(B, H, Lq, Lk)`` result. Keeping the index tensors small and broadcast is also what
makes the first rounds cheap.

Speed: on CPU, the native kernel (attnkit/native/philox.c, built on first use; the same bits)
fills the grid in one vectorised pass when it is available. Otherwise the grid is processed in
torch ops in cache-sized chunks of ``_CPU_CHUNK`` elements (about 300 ms for 8M weights on one
core); other devices get the whole grid in one pass. The
32x32 -> 64-bit multiply uses wrapping int64 multiplication where a one-time self-check on the
device confirms that it wraps, and an overflow-free 16-bit split otherwise. Both give
identical bits.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = ["philox_uniform", "keep_mask", "dropout_multiplier", "draw_seed"]

IndexLike = Union[Tensor, int]

_MASK32 = 0xFFFFFFFF
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_PHILOX_ROUNDS = 10

_BATCH_BITS = 16
_HEAD_BITS = 16
_UNIFORM_BITS = 24

# Elements per chunk on CPU: the ~10 int64 temporaries of a round stay in L2, Python overhead
# per op (~100 ops per chunk) is amortised, and each op stays below ATen's parallel grain
# (32768), so no op pays an OpenMP barrier. Measured on a 2-vCPU EPYC with other load:
# 8192 -> ~470 ms, 16384 -> ~300 ms, 32768 -> ~450 ms (one thread) or 0.3-6 s (two threads,
# oversubscribed) for an (8, 1024, 1024) grid.
_CPU_CHUNK = 16384

# device type -> whether int64 multiplication wraps modulo 2**64 there (checked once).
_WRAPPING_MUL: Dict[str, bool] = {}


# ----------------------------------------------------------------------------- validation


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"seed must be a Python int in [0, 2**64), got {type(seed).__name__}; "
            f"use draw_seed() to draw one from torch's generator")
    if not 0 <= seed < 2**64:
        raise ValueError(
            f"seed must be in [0, 2**64), got {seed}; reduce it modulo 2**64 or use draw_seed()")
    return seed


def _check_offset(offset: int) -> int:
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be a Python int in [0, 2**32), got {type(offset).__name__}")
    if not 0 <= offset < 2**32:
        raise ValueError(
            f"offset must be in [0, 2**32), got {offset}; offset numbers streams (one per call), "
            f"it is not a count of randoms consumed")
    return offset


def _check_p(p: float) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p < 1.0:  # also rejects NaN
        raise ValueError(
            f"dropout_p must satisfy 0 <= dropout_p < 1, got {p}; dropout_p is the probability "
            f"of zeroing a weight (dropout_p=1 would drop everything and scale by infinity)")
    return p


def _as_index(name: str, x: IndexLike, device: torch.device) -> Tensor:
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an integer tensor or int, got bool")
    if isinstance(x, int):
        if not 0 <= x < 2**32:
            raise ValueError(f"{name} must lie in [0, 2**32), got {x}")
        return torch.tensor(x, dtype=torch.int64, device=device)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be an integer tensor or int, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(
            f"{name} must have an integer dtype, got {x.dtype}; build indices with torch.arange")
    if x.device != device:
        raise ValueError(
            f"index tensors must share one device: {name} is on {x.device}, expected {device}")
    return x.to(torch.int64)


def _check_range(name: str, x: Tensor, bits: int) -> None:
    if x.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(x))
    if lo < 0 or hi >= 2**bits:
        raise ValueError(
            f"{name} indices must lie in [0, 2**{bits}), got values in [{lo}, {hi}]; pass "
            f"absolute (not negative or wrapped) {name} indices")


class _Grid(NamedTuple):
    """Validated index grid: the three index-dependent counter words and the output shape."""

    c0: Tensor  # j (the key column; the counter word is worked out from it)
    c1: Tensor  # i
    c2: Tensor  # h + b * 2**16
    shape: torch.Size
    device: torch.device


def _grid(b: IndexLike, h: IndexLike, i: IndexLike, j: IndexLike, check_indices: bool) -> _Grid:
    device = next((x.device for x in (b, h, i, j) if isinstance(x, Tensor)), torch.device("cpu"))
    tb, th, ti, tj = (_as_index(n, x, device) for n, x in zip("bhij", (b, h, i, j)))
    try:
        shape = torch.broadcast_shapes(tb.shape, th.shape, ti.shape, tj.shape)
    except RuntimeError as e:
        raise ValueError(
            f"b, h, i, j must broadcast together, got shapes {tuple(tb.shape)}, "
            f"{tuple(th.shape)}, {tuple(ti.shape)}, {tuple(tj.shape)}; give each its own axis, "
            f"e.g. b[:, None, None, None], h[None, :, None, None], ...") from e
    if check_indices:
        for name, x, bits in (("b", tb, _BATCH_BITS), ("h", th, _HEAD_BITS),
                              ("i", ti, 32), ("j", tj, 32)):
            _check_range(name, x, bits)
    return _Grid(tj, ti, torch.bitwise_or(th, tb << _HEAD_BITS), shape, device)


# ----------------------------------------------------------------------------- philox core


def _wrapping_mul_ok(device: torch.device) -> bool:
    """Whether int64 multiplication on ``device`` wraps modulo 2**64 (checked once per type)."""
    known = _WRAPPING_MUL.get(device.type)
    if known is not None:
        return known
    # 67 values: exercises vectorised bodies and scalar tails of the elementwise kernels.
    xs = [(0x9E3779B97F4A7C15 * (n + 1)) & _MASK32 for n in range(64)] + [0, 1, _MASK32]
    x = torch.tensor(xs, dtype=torch.int64, device=device)
    ok = True
    for m in (_PHILOX_M0, _PHILOX_M1):
        got = (x * m).tolist()
        want = [((v * m + 2**63) % 2**64) - 2**63 for v in xs]
        ok = ok and got == want
    _WRAPPING_MUL[device.type] = ok
    return ok


def _mulhilo_wrap(x: Tensor, m: int) -> Tuple[Tensor, Tensor]:
    """(hi, lo) words of x * m for 0 <= x < 2**32, using wrapping int64 multiplication.

    Only the low 32 bits of each result are meaningful; callers mask after combining.
    """
    lo = x * m  # the true product modulo 2**64, read as a signed int64
    return lo >> 32, lo


def _mulhilo_split(x: Tensor, m: int) -> Tuple[Tensor, Tensor]:
    """(hi, lo) words of x * m for 0 <= x < 2**32 without int64 overflow (16-bit halves)."""
    a = x >> 16
    a *= m  # < 2**48
    b = x & 0xFFFF
    b *= m  # < 2**48
    lo = a & 0xFFFF
    lo <<= 16
    lo += b
    b >>= 16
    a += b
    a >>= 16  # floor(x * m / 2**32), exact
    return a, lo


def _philox_word(
    j: Tensor, c1: Tensor, c2: Tensor, c3: int, k0: int, k1: int, wrap: bool
) -> Tensor:
    """Key column ``j``'s output word of Philox-4x32-10, in the low 32 bits of the result.

    The call's counter is ``(16 * (j // 64) + j % 16, c1, c2, c3)`` and ``j`` takes its word
    ``(j // 16) % 4`` (module docstring). One round (Random123's philox4x32round)::

        hi0:lo0 = M0 * c0        hi1:lo1 = M1 * c2
        (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0,  lo1,  hi0 ^ c3 ^ k1,  lo0)

    with the key bumped by (W0, W1) between rounds. Words feeding a multiply are masked to
    32 bits; ``lo`` words are only ever xor-ed and then masked, so they stay unmasked, and the
    bits above 32 of the result are garbage for the caller to drop.
    """
    mulhilo = _mulhilo_wrap if wrap else _mulhilo_split
    c0 = torch.bitwise_or((j >> 6) << 4, j & 15)
    x1: Union[Tensor, int] = c1
    x3: Union[Tensor, int] = c3
    for r in range(_PHILOX_ROUNDS):
        if r:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi1, lo1 = mulhilo(c2, _PHILOX_M1)
        n0 = torch.bitwise_xor(hi1, x1)
        n0 ^= k0
        n0 &= _MASK32
        hi0, lo0 = mulhilo(c0, _PHILOX_M0)
        if isinstance(x3, int):  # first round: c3 = offset is a scalar
            hi0 ^= x3 ^ k1
            n2 = hi0
        else:
            n2 = torch.bitwise_xor(hi0, x3)
            n2 ^= k1
        n2 &= _MASK32
        c0, x1, c2, x3 = n0, lo1, n2, lo0
    word = (j >> 4) & 3
    out = torch.where(word == 2, c2, x3)
    out = torch.where(word == 1, x1, out)
    return torch.where(word == 0, c0, out)


def _chunks(shape: torch.Size, target: int) -> Iterator[Tuple[slice, ...]]:
    """Cover an N-d grid with blocks of at most max(target, 1) elements (whole trailing dims)."""
    n = len(shape)
    k, inner = n - 1, 1
    while k > 0 and inner * shape[k] <= target:
        inner *= shape[k]
        k -= 1
    if n == 0:
        yield ()
        return
    if inner * shape[k] <= target:  # everything fits
        yield tuple(slice(None) for _ in shape)
        return
    step = max(1, target // inner)
    outer = itertools.product(*(range(s) for s in shape[:k]))
    for lead in outer:
        for s in range(0, shape[k], step):
            yield (tuple(slice(t, t + 1) for t in lead) + (slice(s, s + step),)
                   + tuple(slice(None) for _ in range(k + 1, n)))


def _sub(x: Tensor, idx: Tuple[slice, ...], ndim: int) -> Tensor:
    """The part of broadcastable ``x`` (right-aligned to ``ndim`` dims) under block ``idx``."""
    x = x.reshape((1,) * (ndim - x.dim()) + tuple(x.shape))
    return x[tuple(sl if size != 1 else slice(None) for sl, size in zip(idx, x.shape))]


def _fill(seed: int, offset: int, grid: _Grid, out: Tensor,
          convert: Callable[[Tensor, Tensor], None], threshold: Optional[int] = None) -> Tensor:
    """Run Philox over ``grid`` chunk by chunk; ``convert(word, out[chunk])`` stores results.
    On CPU the native kernel (:func:`attnkit.native.philox_fill`, the same bits) does it in
    one pass when it is available: ``threshold`` for a keep mask, None for uniforms."""
    if grid.device.type == "cpu" and len(grid.shape) <= 4 and out.numel():
        from .. import native

        if native.philox_fill(grid.c0, grid.c1, grid.c2, seed, offset, out, threshold):
            return out
    k0, k1 = seed & _MASK32, seed >> 32
    wrap = _wrapping_mul_ok(grid.device)
    if grid.device.type == "cpu":
        target = _CPU_CHUNK
    else:  # accelerators want one large launch per op
        target = max(1, math.prod(grid.shape))
    nd = len(grid.shape)
    for idx in _chunks(grid.shape, target):
        w = _philox_word(_sub(grid.c0, idx, nd), _sub(grid.c1, idx, nd),
                          _sub(grid.c2, idx, nd), offset, k0, k1, wrap)
        convert(w, out[idx])
    return out


def _top_bits(w: Tensor) -> Tensor:
    """The 24-bit integer k of ``uniform = k * 2**-24`` (in place on ``w``)."""
    w >>= 32 - _UNIFORM_BITS
    w &= (1 << _UNIFORM_BITS) - 1
    return w


# ----------------------------------------------------------------------------- public API


def philox_uniform(
    seed: int, offset: int, b: IndexLike, h: IndexLike, i: IndexLike, j: IndexLike,
    *, check_indices: bool = True,
) -> Tensor:
    """Uniform float32 randoms in [0, 1) for attention weights ``(b, h, i, j)``.

    The value for one weight depends only on ``seed``, ``offset`` and its absolute coordinates
    (see the module docstring for the counter layout), never on how the grid is tiled.

    Args:
        seed: Philox key, an int in [0, 2**64); see :func:`draw_seed`.
        offset: stream number in [0, 2**32) (one per attention call sharing a seed).
        b, h, i, j: broadcastable integer tensors (or ints) of absolute batch, query-head,
            query-row and key-column indices, all on one device.
        check_indices: check that the indices are in range (one reduction per index tensor,
            which synchronises a GPU); a tiled loop can check its full grid once and pass
            ``False`` per tile.

    Returns:
        float32 tensor of the broadcast shape on the indices' device; values ``k * 2**-24``.
    """
    _check_seed(seed)
    _check_offset(offset)
    grid = _grid(b, h, i, j, check_indices)

    def convert(w: Tensor, dst: Tensor) -> None:
        torch.mul(_top_bits(w).expand(dst.shape), 2.0**-_UNIFORM_BITS, out=dst)

    out = torch.empty(grid.shape, dtype=torch.float32, device=grid.device)
    return _fill(seed, offset, grid, out, convert)


def keep_mask(
    seed: int, offset: int, p: float, b: IndexLike, h: IndexLike, i: IndexLike, j: IndexLike,
    *, check_indices: bool = True,
) -> Tensor:
    """Bool tensor: True where weight ``(b, h, i, j)`` survives dropout with probability ``p``.

    ``keep == (philox_uniform(...) >= p)`` with the comparison exact (``p`` is not rounded to
    float32). ``p = 0`` keeps everything without drawing. Arguments as in
    :func:`philox_uniform`; ``p`` is the drop probability, ``0 <= p < 1``.
    """
    _check_p(p)
    _check_seed(seed)
    _check_offset(offset)
    grid = _grid(b, h, i, j, check_indices)
    if p == 0.0:
        return torch.ones(grid.shape, dtype=torch.bool, device=grid.device)
    # uniform = k * 2**-24 >= p  <=>  k >= ceil(p * 2**24)   (p * 2**24 is exact in float64)
    threshold = math.ceil(p * 2.0**_UNIFORM_BITS)

    def convert(w: Tensor, dst: Tensor) -> None:
        torch.ge(_top_bits(w).expand(dst.shape), threshold, out=dst)

    out = torch.empty(grid.shape, dtype=torch.bool, device=grid.device)
    return _fill(seed, offset, grid, out, convert, threshold)


def dropout_multiplier(
    seed: int, offset: int, p: float, b: IndexLike, h: IndexLike, i: IndexLike, j: IndexLike,
    *, dtype: torch.dtype = torch.float32, check_indices: bool = True,
) -> Tensor:
    """``keep / (1 - p)``: 0 for dropped weights, ``1 / (1 - p)`` for kept ones.

    Multiply the softmax probabilities by this (forward) and the incoming gradient by the same
    tensor (backward). Arguments as in :func:`keep_mask`; ``dtype`` is the result's float dtype.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype}")
    keep = keep_mask(seed, offset, p, b, h, i, j, check_indices=check_indices)
    scale = torch.full((), 1.0 / (1.0 - p), dtype=dtype, device=keep.device)
    return torch.where(keep, scale, torch.zeros((), dtype=dtype, device=keep.device))


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """Draw a 63-bit Philox seed from ``generator`` (default: torch's global CPU generator).

    ``torch.manual_seed(s)`` therefore makes a run's dropout masks reproducible.
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator)}")
    device = generator.device if generator is not None else "cpu"
    seed = torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, generator=generator,
                         device=device)
    return int(seed.item())
