"""The benchmark catalog: every workload is a :class:`Case`, a plain frozen record.

A case says *what* is computed (shapes, mask, score changes), never *how*: each peer in
:mod:`attnkit.bench.peers` translates it into its own calls, and :meth:`Case.features` is the
vocabulary they check it against. Adding a workload is adding a ``Case(...)`` to
:data:`CATALOG`; adding a kind of workload (varlen, paged decode, dropout ...) is adding a
field (or an ``extra`` key, which becomes a feature of the same name) and teaching the peers
that can express it: peers that do not know a feature report it as "cannot express", so an
unknown feature can never be silently ignored. For example, a dropout case is one line::

    Case("dropout_4k", len_q=4096, causal=True, extra={"dropout_p": 0.1})

and every peer reports "cannot express dropout_p" until its adapter reads
``case.extra["dropout_p"]`` and lists ``"dropout_p"`` in its ``FEATURES``.

Shape legend (the same for every peer)::

    q (B, Hq, Lq, d_qk)    k (B, Hkv, Lk, d_qk)    v (B, Hkv, Lk, d_v)    out (B, Hq, Lq, d_v)

Suites:

* ``quick``    -- small shapes (mostly L <= 1024), every workload once; under 2 minutes on 2
  cores, whatever the CPU (the cases share a time budget: ``attnkit bench --budget``).
* ``standard`` -- the suite of the benchmark pages' figures (docs/benchmarks): B=1, H=8, d=64,
  L=4096..8192, a small call and a 32k-token memory check.
* ``long``     -- ``standard`` plus long contexts (32k..64k tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

import numpy as np

SUITES: Tuple[str, ...] = ("quick", "standard", "long", "compile")
PASSES: Tuple[str, ...] = ("fwd", "fwd+bwd")
DIAGONALS: Tuple[str, ...] = ("top_left", "bottom_right")

# Which suites include a case tagged with a given suite: ``long`` runs everything ``standard``
# does, plus its own cases.
_SUITE_INCLUDES: Dict[str, Tuple[str, ...]] = {
    "quick": ("quick",),
    "standard": ("standard",),
    "long": ("standard", "long"),
    "compile": ("compile",),
}


@dataclass(frozen=True)
class Case:
    """One named workload.

    Masks combine with AND, except ``prefix`` (prefix-LM), which is its own complete mask
    (``kv_idx <= q_idx or kv_idx < prefix``). Every combination used here keeps each query
    row's visible keys one contiguous range, which is what :mod:`attnkit.bench.flops` counts.

    Attributes:
        name: unique name, used by ``--only``.
        batch, heads_q, heads_kv, len_q, len_kv, d_qk, d_v: shapes (``None`` = same as the
            query-side value).
        causal: key j is visible from query i iff ``j <= i'`` (``i' = i`` top-left,
            ``i + Lk - Lq`` bottom-right; see ``diagonal``).
        window: ``(left, right)``, key j visible iff ``i' - left <= j <= i' + right``; ``None``
            on a side = unbounded.
        documents: pack this many documents of random (seeded) lengths into the sequence; a
            query sees only keys of its own document (AND causal when ``causal``).
        prefix: prefix-LM with a bidirectional prefix of this many tokens.
        alibi: ALiBi with the standard slopes (FlashAttention's convention).
        softcap: ``cap * tanh(score / cap)`` on the scaled scores.
        relative_bias: a learnable ``(Hq, 2M - 1)`` relative-position table, ``M = max(Lq, Lk)``
            (the convention of :func:`attnkit.score_mods.relative_bias`); it gets a gradient.
        layout: how q, k, v and the output's gradient lie in memory: ``"bhld"`` contiguous
            ``(B, H, L, D)``; ``"blhd"`` ``(B, L, H, D)`` tensors seen as ``(B, H, L, D)``
            (``x.transpose(1, 2)``, what model code passes: rows ``H * D`` apart).
        suites: the suites that run this case.
        passes: the passes that make sense for it.
        dtypes: restrict to these dtypes (``None`` = whatever the run asks for).
        peers: restrict to these peers (``None`` = whatever the run asks for); the others get
            a "skipped" row, so the restriction stays visible.
        repeat: cap on the number of timed rounds (slow cases).
        warmup: run every callable once before timing (off for cases where one call is long).
        memory: measure peak memory even without ``--memory``.
        extra: parameters of features added later (``{"dropout_p": 0.1}`` ...); every key is
            reported by :meth:`features`, so peers that cannot express it say so.
        seed: seed for inputs and document lengths.
        note: one line on what the case checks.
    """

    name: str
    batch: int = 1
    heads_q: int = 8
    heads_kv: Optional[int] = None
    len_q: int = 1024
    len_kv: Optional[int] = None
    d_qk: int = 64
    d_v: Optional[int] = None
    causal: bool = False
    diagonal: str = "top_left"
    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    documents: int = 0
    prefix: int = 0
    alibi: bool = False
    softcap: Optional[float] = None
    relative_bias: bool = False
    layout: str = "bhld"
    suites: Tuple[str, ...] = ("standard",)
    passes: Tuple[str, ...] = PASSES
    dtypes: Optional[Tuple[str, ...]] = None
    peers: Optional[Tuple[str, ...]] = None
    repeat: Optional[int] = None
    warmup: bool = True
    memory: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        for attr in ("batch", "heads_q", "len_q", "d_qk"):
            if getattr(self, attr) < 1:
                raise ValueError(f"case {self.name!r}: {attr} must be >= 1")
        if self.hkv < 1 or self.heads_q % self.hkv:
            raise ValueError(
                f"case {self.name!r}: heads_q={self.heads_q} must be a multiple of "
                f"heads_kv={self.hkv}")
        if self.layout not in ("bhld", "blhd"):
            raise ValueError(f"case {self.name!r}: layout must be 'bhld' or 'blhd'; got "
                             f"{self.layout!r}")
        if self.diagonal not in DIAGONALS:
            raise ValueError(f"case {self.name!r}: diagonal must be one of {DIAGONALS}")
        if (self.documents or self.prefix) and self.len_q != self.lk:
            raise ValueError(f"case {self.name!r}: documents/prefix need len_q == len_kv")
        if self.documents and self.documents > self.len_q:
            raise ValueError(f"case {self.name!r}: more documents than tokens")
        if self.prefix and (self.causal or self.window or self.documents):
            raise ValueError(
                f"case {self.name!r}: prefix-LM is a complete mask; do not combine it with "
                "causal, window or documents")
        unknown = [s for s in self.suites if s not in SUITES]
        if unknown:
            raise ValueError(f"case {self.name!r}: unknown suites {unknown}; use {SUITES}")
        lens = self.seqlens()
        if lens and (len(lens) != self.batch or max(lens) != self.len_q or min(lens) < 1
                     or self.lk != self.len_q):
            raise ValueError(f"case {self.name!r}: seqlens need one length >= 1 per batch "
                             "element, the longest == len_q == len_kv")
        bad = [p for p in self.passes if p not in PASSES]
        if bad:
            raise ValueError(f"case {self.name!r}: unknown passes {bad}; use {PASSES}")

    # ---- derived sizes ---------------------------------------------------------------------
    @property
    def hkv(self) -> int:
        """Key/value heads."""
        return self.heads_q if self.heads_kv is None else self.heads_kv

    @property
    def lk(self) -> int:
        """Key/value length."""
        return self.len_q if self.len_kv is None else self.len_kv

    @property
    def dv(self) -> int:
        """Value head dim."""
        return self.d_qk if self.d_v is None else self.d_v

    @property
    def offset(self) -> int:
        """``i' - i``: 0 for top-left alignment, ``Lk - Lq`` for bottom-right."""
        return self.lk - self.len_q if self.diagonal == "bottom_right" else 0

    @property
    def pairs(self) -> int:
        """All (query, key) pairs over batch and query heads: ``B * Hq * Lq * Lk``."""
        return self.batch * self.heads_q * self.len_q * self.lk

    @property
    def max_distance(self) -> int:
        """``M`` of the relative-bias table ``(Hq, 2M - 1)``."""
        return max(self.len_q, self.lk)

    def features(self) -> FrozenSet[str]:
        """Names of everything a peer must express to run this case."""
        f = set()
        if self.causal:
            f.add("causal")
        if self.diagonal == "bottom_right" and (self.causal or self.window):
            f.add("bottom_right")
        if self.window is not None:
            f.add("window")
        if self.documents:
            f.add("documents")
        if self.prefix:
            f.add("prefix_lm")
        if self.hkv != self.heads_q:
            f.add("gqa")
        if self.alibi:
            f.add("alibi")
        if self.softcap is not None:
            f.add("softcap")
        if self.relative_bias:
            f.add("relative_bias")
        if self.dv != self.d_qk:
            f.add("d_v")
        f.update(self.extra)
        return frozenset(f)

    def seqlens(self) -> List[int]:
        """Real length of each batch element (``extra["seqlens"]``); ``[]`` when unpadded.

        Cases with ``seqlens`` are right-padded batches: element ``b`` has ``seqlens[b]``
        real tokens (queries and keys, ``len_q == len_kv == max(seqlens)``); keys past it are
        invisible and query rows past it give 0. ``extra["varlen"]`` says the same batch is
        given to attnkit packed (``varlen_attention``).
        """
        return [int(x) for x in self.extra.get("seqlens", ())]

    def doc_lengths(self) -> List[int]:
        """Lengths of the packed documents (seeded, each >= 1, summing to ``len_q``)."""
        if not self.documents:
            return []
        rng = np.random.default_rng(self.seed + 1)
        cuts = np.sort(rng.choice(np.arange(1, self.len_q), self.documents - 1, replace=False))
        edges = np.concatenate([[0], cuts, [self.len_q]])
        return [int(x) for x in np.diff(edges)]

    def shape_str(self) -> str:
        """Compact shape, e.g. ``B1 H32/8 L1024/8192 d192/128``."""
        h = f"H{self.heads_q}" + (f"/{self.hkv}" if self.hkv != self.heads_q else "")
        ln = f"L{self.len_q}" + (f"/{self.lk}" if self.lk != self.len_q else "")
        d = f"d{self.d_qk}" + (f"/{self.dv}" if self.dv != self.d_qk else "")
        return f"B{self.batch} {h} {ln} {d}"

    def describe(self) -> Dict[str, Any]:
        """JSON-ready description (the ``cases`` entries of the report)."""
        from .flops import visible_pairs

        vis = visible_pairs(self)
        return {
            "name": self.name, "batch": self.batch, "heads_q": self.heads_q,
            "heads_kv": self.hkv, "len_q": self.len_q, "len_kv": self.lk, "d_qk": self.d_qk,
            "d_v": self.dv, "causal": self.causal, "diagonal": self.diagonal,
            "window": list(self.window) if self.window is not None else None,
            "documents": self.doc_lengths() or None, "prefix": self.prefix or None,
            "alibi": self.alibi, "softcap": self.softcap,
            "relative_bias": self.relative_bias, "extra": dict(self.extra),
            "features": sorted(self.features()), "visible_pairs": vis,
            "visible_fraction": vis / self.pairs, "note": self.note,
        }


def random_lengths(n: int, total: int, seed: int) -> Tuple[int, ...]:
    """``n`` seeded random lengths, each >= 1, summing to ``total`` (varlen cases)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, total), n - 1, replace=False))
    return tuple(int(x) for x in np.diff(np.concatenate([[0], cuts, [total]])))


VARLEN_16K = random_lengths(8, 16384, seed=16)
"""Sequence lengths of ``varlen_16k`` (seeded; sum 16384)."""

_Q = ("quick",)
_S = ("standard",)
_L = ("long",)
_C = ("compile",)

# Workloads; quick versions are small copies of the standard ones.
CATALOG: Tuple[Case, ...] = (
    # ---- quick: every workload small; ~1 minute in total on 2 cores
    Case("dense_1k", heads_q=4, len_q=1024, suites=_Q, note="no mask"),
    Case("causal_1k", heads_q=4, len_q=1024, causal=True, suites=_Q),
    Case("causal_br_256_1k", heads_q=4, len_q=256, len_kv=1024, causal=True,
         diagonal="bottom_right", suites=_Q, note="chunked prefill, Lq != Lk"),
    Case("window_1k", heads_q=4, len_q=1024, causal=True, window=(128, 0), suites=_Q),
    Case("document_1k", heads_q=4, len_q=1024, causal=True, documents=8, suites=_Q),
    Case("prefix_lm_1k", heads_q=4, len_q=1024, prefix=256, suites=_Q),
    Case("gqa_512", heads_q=32, heads_kv=8, len_q=512, d_qk=128, causal=True, suites=_Q),
    Case("alibi_1k", heads_q=4, len_q=1024, causal=True, alibi=True, suites=_Q),
    Case("softcap_1k", heads_q=4, len_q=1024, causal=True, softcap=5.0, suites=_Q),
    Case("relbias_1k", heads_q=4, len_q=1024, causal=True, relative_bias=True, suites=_Q),
    Case("paged_decode_2k", batch=4, heads_q=32, heads_kv=8, len_q=1, len_kv=2048, d_qk=128,
         causal=True, diagonal="bottom_right", suites=_Q, passes=("fwd",),
         extra={"page_size": 256}, note="decode over a paged KV cache; KV GB/s vs memcpy"),
    Case("dqk192_512", heads_q=4, len_q=512, d_qk=192, d_v=128, causal=True, suites=_Q),
    Case("small_256", heads_q=8, len_q=256, suites=_Q + _S,
         note="small call: fixed overheads"),
    Case("long_8k", heads_q=1, len_q=8192, causal=True, suites=_Q, repeat=2, memory=True,
         note="memory check, quick size"),
    # ---- standard (the benchmark pages' figures): B=1, H=8, d=64
    Case("dense_4k", len_q=4096, suites=_S),
    Case("causal_4k", len_q=4096, causal=True, suites=_S),
    Case("causal_4k_blhd", len_q=4096, causal=True, layout="blhd", suites=_S,
         note="causal_4k on transposed views, the layout model code passes"),
    Case("causal_br_1k_8k", len_q=1024, len_kv=8192, causal=True, diagonal="bottom_right",
         suites=_S, note="chunked prefill, Lq != Lk"),
    Case("window_8k", len_q=8192, causal=True, window=(512, 0), suites=_S),
    Case("document_8k", len_q=8192, causal=True, documents=8, suites=_S),
    Case("prefix_lm_4k", len_q=4096, prefix=1024, suites=_S),
    Case("gqa_2k", heads_q=32, heads_kv=8, len_q=2048, d_qk=128, causal=True, suites=_S),
    Case("alibi_8k", len_q=8192, causal=True, alibi=True, suites=_S),
    Case("softcap_8k", len_q=8192, causal=True, softcap=5.0, suites=_S),
    Case("relbias_8k", len_q=8192, causal=True, relative_bias=True, suites=_S),
    Case("dqk192_4k", len_q=4096, d_qk=192, d_v=128, causal=True, suites=_S),
    Case("long_32k", len_q=32768, causal=True, suites=_S, dtypes=("float32",),
         peers=("attnkit", "sdpa"), repeat=1, warmup=False, memory=True,
         note="memory: O(L) extra, not O(L^2)"),
    # ---- workloads beyond one dense call (standard suite)
    Case("varlen_16k", batch=8, len_q=max(VARLEN_16K), causal=True, suites=_S,
         extra={"seqlens": VARLEN_16K, "varlen": True},
         note="8 packed sequences, 16384 tokens; sdpa gets the padded batch + bool mask"),
    Case("padded_batch", batch=4, len_q=4096, causal=True, suites=_S,
         extra={"seqlens": (4096, 3000, 2000, 1000)},
         note="right padding: attnkit seqlens_q/kv, sdpa a dense padding mask"),
    Case("paged_decode", batch=8, heads_q=32, heads_kv=8, len_q=1, len_kv=8192, d_qk=128,
         causal=True, diagonal="bottom_right", suites=_S, passes=("fwd",),
         dtypes=("bfloat16",), extra={"page_size": 256},
         note="decode over a paged KV cache (shuffled pages); KV GB/s vs memcpy"),
    Case("decode_8k", batch=8, heads_q=32, heads_kv=8, len_q=1, len_kv=8192, d_qk=128,
         causal=True, diagonal="bottom_right", suites=_S, passes=("fwd",),
         note="decode over a contiguous KV cache (attention(), the fused executor's decode rows)"),
    Case("paged_decode_1x32k", batch=1, heads_q=32, heads_kv=8, len_q=1, len_kv=32768,
         d_qk=128, causal=True, diagonal="bottom_right", suites=_S, passes=("fwd",),
         dtypes=("bfloat16",), extra={"page_size": 256},
         note="one long sequence: keys split across threads (flash-decoding)"),
    # ---- fp8 (run with --only paged_decode,paged_decode_fp8,causal_4k,causal_4k_fp8 and the
    # bfloat16 dtype: the ratios fp8 / bf16 come from one run)
    Case("paged_decode_fp8", batch=8, heads_q=32, heads_kv=8, len_q=1, len_kv=8192, d_qk=128,
         causal=True, diagonal="bottom_right", suites=_S, passes=("fwd",),
         dtypes=("bfloat16",), extra={"page_size": 256, "fp8": "e4m3"},
         note="paged_decode over an e4m3 cache (per-page scales, read in place); GB/s "
              "count the fp8 bytes (1 per element)"),
    Case("causal_4k_fp8", len_q=4096, causal=True, suites=_S, passes=("fwd",),
         dtypes=("bfloat16",), extra={"fp8": "e4m3"},
         note="causal_4k on e4m3 q/k/v (per-head descales); err is vs the unquantized "
              "reference, so it includes the quantization"),
    Case("dropout_4k", len_q=4096, causal=True, suites=_S, extra={"dropout_p": 0.1},
         note="random masks differ across peers: attnkit checked against its own keep mask"),
    # ---- inside torch.compile(fullgraph=True): the attention call of a compiled model (the
    # projections, norms and rotary embedding around it are the same for every peer)
    Case("compiled_dense_4k", len_q=4096, suites=_C),
    Case("compiled_causal_4k", len_q=4096, causal=True, suites=_C),
    Case("compiled_window_4k", len_q=4096, causal=True, window=(512, 0), suites=_C),
    Case("compiled_document_4k", len_q=4096, causal=True, documents=8, suites=_C),
    # ---- long contexts
    Case("long_32k_bf16", len_q=32768, causal=True, suites=_L, dtypes=("bfloat16",),
         peers=("attnkit", "sdpa"), repeat=1, warmup=False, memory=True),
    Case("window_64k", len_q=65536, causal=True, window=(512, 0), suites=_L, repeat=2,
         warmup=False, memory=True),
    Case("document_32k", len_q=32768, causal=True, documents=8, suites=_L, repeat=1,
         warmup=False, memory=True),
    Case("causal_64k", len_q=65536, causal=True, suites=_L, passes=("fwd",), repeat=1,
         warmup=False, memory=True),
)


def catalog() -> Dict[str, Case]:
    """All cases by name."""
    return {c.name: c for c in CATALOG}


def select(suite: str, only: Optional[Iterable[str]] = None,
           cases: Iterable[Case] = CATALOG) -> List[Case]:
    """The cases of ``suite`` in catalog order, or exactly the cases named in ``only``.

    ``only`` may name any case in the catalog, whatever its suite.
    """
    cases = list(cases)
    if only:
        by_name = {c.name: c for c in cases}
        names = list(only)
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(
                f"unknown case(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
        return [by_name[n] for n in names]
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}; got {suite!r}")
    tags = _SUITE_INCLUDES[suite]
    return [c for c in cases if any(t in c.suites for t in tags)]
