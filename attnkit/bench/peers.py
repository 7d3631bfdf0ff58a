"""The implementations measured, one small adapter each, all on the same inputs.

=================  ============================================================================
``attnkit``        :func:`attnkit.attention` with what a user would pass: native ``causal``,
                   ``window``, ``diagonal``, ``softcap``, ``alibi_slopes``; a BlockMask built
                   once (outside the timing) for documents and prefix-LM; the relative bias as
                   :func:`attnkit.score_mods.relative_bias` over a learnable table.
``sdpa``           ``torch.nn.functional.scaled_dot_product_attention``: native ``is_causal``,
                   ``causal_lower_right`` and ``enable_gqa`` where they apply, a dense bool mask
                   or float bias otherwise (built outside the timing, except the learnable
                   relative bias, gathered from its table inside the call so it gets a
                   gradient). It cannot express softcap.
``flex``           torch FlexAttention, eager: mask_mod/score_mod closures and a torch BlockMask
                   built outside the timing. Eager mode materialises the ``B*H*Lq*Lk`` scores.
``flex_compiled``  the same under ``torch.compile``; the first call's compile time is reported
                   apart. On CPU FlexAttention has no backward: ``fwd+bwd`` is marked, not run.
``naive``          the textbook baseline: scores materialised in the input dtype, masked,
                   softmaxed (:func:`attnkit.bench.workloads.dense_attention`).
=================  ============================================================================

Each adapter declares the case features it can express (``FEATURES``) and whether it has a
backward; :meth:`Peer.supports` turns that into a list of reasons (empty = it can run), so a
feature added to the catalog later is reported as "cannot express ..." by every peer that was
not taught it. :meth:`Peer.extra_bytes` estimates the memory a peer allocates beyond the
inputs; the runner skips a peer whose estimate exceeds the memory budget.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, FrozenSet, List, Optional

import torch
from torch import Tensor

from .cases import Case
from .workloads import Workload, alibi_bias, dense_attention, relative_index

Forward = Callable[[Tensor, Tensor, Tensor], Tensor]

ALL_FEATURES: FrozenSet[str] = frozenset({
    "causal", "bottom_right", "window", "documents", "prefix_lm", "gqa", "alibi", "softcap",
    "relative_bias", "d_v"})

WORKLOAD_FEATURES: FrozenSet[str] = frozenset({"seqlens", "varlen", "page_size", "dropout_p"})
"""``extra`` features that attnkit and torch SDPA are taught (see :func:`Attnkit.build`,
:func:`Sdpa.build`): padded batches, packed varlen, a paged KV cache, dropout. FlexAttention
and the naive baseline are not: they report "cannot express ..."."""

def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Peer:
    """One implementation under test. Subclasses fill the class attributes and :meth:`build`."""

    name: str = ""
    label: str = ""
    FEATURES: FrozenSet[str] = frozenset()
    backward: bool = True
    no_backward_reason: str = "no backward"
    compiled: bool = False
    max_rounds: Optional[int] = None
    """Cap on timed rounds: slow baselines need fewer to show where they stand."""

    def supports(self, case: Case, pass_: str) -> List[str]:
        """Reasons this peer cannot run ``case`` in ``pass_`` (empty list = it can)."""
        reasons = [f"cannot express {f}" for f in sorted(case.features() - self.FEATURES)]
        if pass_ == "fwd+bwd" and not self.backward:
            reasons.append(self.no_backward_reason)
        return reasons

    def extra_bytes(self, case: Case, pass_: str, dtype: torch.dtype) -> int:
        """Estimated bytes allocated beyond the inputs (for the memory budget)."""
        return 0

    def remarks(self, case: Case, pass_: str) -> List[str]:
        """How the case reaches this peer, when that is worth a note (e.g. "dense bool mask")."""
        return []

    def build(self, w: Workload, table: Optional[Tensor]) -> Forward:
        """A ``forward(q, k, v) -> out`` with everything input-independent prepared.

        ``table`` is the relative-bias table to use (the workload's, or a leaf that requires
        grad for ``fwd+bwd``); masks are built here, outside the timed calls.
        """
        raise NotImplementedError


# --------------------------------------------------------------------------- attnkit


def attnkit_kwargs(w: Workload, table: Optional[Tensor],
                   slopes: Optional[Tensor] = None) -> Dict[str, Any]:
    """Keywords of :func:`attnkit.attention` for the workload (also fed to the reference)."""
    c = w.case
    kw: Dict[str, Any] = {}
    if c.documents or c.prefix:
        kw["mask"] = w.cached("attnkit_block_mask", lambda: _attnkit_block_mask(c))
    else:
        if c.causal:
            kw["causal"] = True
        if c.window is not None:
            kw["window"] = c.window
        if c.diagonal != "top_left":
            kw["diagonal"] = c.diagonal
    if c.softcap is not None:
        kw["softcap"] = c.softcap
    if c.seqlens():
        lens = torch.tensor(c.seqlens())
        kw["seqlens_q"] = lens
        kw["seqlens_kv"] = lens
    if c.alibi:
        kw["alibi_slopes"] = w.slopes if slopes is None else slopes
    if c.relative_bias:
        from attnkit.score_mods import relative_bias

        kw["score_mod"] = relative_bias(table)
    return kw


def _attnkit_mask_mod(c: Case) -> Any:
    from attnkit import masks

    if c.prefix:
        return masks.prefix_lm(c.prefix)
    doc = masks.document_from_lengths(c.doc_lengths())
    return masks.and_masks(masks.causal(), doc) if c.causal else doc


def _attnkit_block_mask(c: Case) -> Any:
    """attnkit BlockMask of the case's mask_mod; the bare mask_mod while block_mask is absent."""
    mod = _attnkit_mask_mod(c)
    try:
        from attnkit.block_mask import create_block_mask
    except ImportError:
        return mod
    return create_block_mask(mod, None, None, c.len_q, c.lk, device="cpu")


def packed_index(c: Case) -> Tensor:
    """int64 ``(T,)``: positions of the real tokens in the flattened ``(B * L)`` padded batch."""
    lens = torch.tensor(c.seqlens())
    valid = torch.arange(c.len_q).view(1, -1) < lens.view(-1, 1)
    return valid.reshape(-1).nonzero().view(-1)


def cu_seqlens(c: Case) -> Tensor:
    """int32 ``(B + 1,)`` cumulative sequence lengths of a varlen case."""
    lens = torch.tensor([0] + c.seqlens(), dtype=torch.int64)
    return torch.cumsum(lens, 0).to(torch.int32)


class _Pack(torch.autograd.Function):
    """``(B, H, L, D)`` padded batch -> ``(T, H, D)`` packed tokens: one gather of the real
    rows (no copy of the padded batch); the gradient is scattered back into zeros."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, rows: Tensor, cols: Tensor, flat: Tensor) -> Tensor:
        ctx.save_for_backward(flat)
        ctx.shape = x.shape
        return x.transpose(1, 2)[rows, cols]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        (flat,) = ctx.saved_tensors
        b, h, n, d = ctx.shape
        gx = g.new_zeros(b, n, h, d)
        gx.view(b * n, h, d).index_copy_(0, flat, g)
        return gx.transpose(1, 2), None, None, None


class _Unpack(torch.autograd.Function):
    """``(T, H, D)`` packed output -> ``(B, H, L, D)`` zero-padded batch: one gather through a
    map whose padding entries point at an appended zero row."""

    @staticmethod
    def forward(ctx: Any, o: Tensor, rows: Tensor, cols: Tensor, gmap: Tensor, b: int,
                n: int) -> Tensor:
        ctx.save_for_backward(rows, cols)
        t, h, d = o.shape
        padded = torch.cat([o, o.new_zeros(1, h, d)]).index_select(0, gmap)
        return padded.view(b, n, h, d).transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        rows, cols = ctx.saved_tensors
        return g.transpose(1, 2)[rows, cols], None, None, None, None, None


def _pack_maps(c: Case) -> Any:
    """(batch row, position, flat index) of each real token, and the flat padded position ->
    packed row map (``T`` for padding)."""
    flat = packed_index(c)
    gmap = torch.full((c.batch * c.len_q,), flat.numel(), dtype=torch.int64)
    gmap[flat] = torch.arange(flat.numel())
    return flat // c.len_q, flat % c.len_q, flat, gmap


def _attnkit_varlen(w: Workload) -> Forward:
    """``varlen_attention`` on the packed batch; the pack (a gather of the real rows) and the
    unpack (a gather into a zero-padded output) run inside the call, so every peer returns the
    same padded tensor."""
    import attnkit

    c = w.case
    rows, cols, flat, gmap = w.cached("pack_maps", lambda: _pack_maps(c))
    cu = w.cached("cu_seqlens", lambda: cu_seqlens(c))
    b, n = c.batch, c.len_q

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        qp, kp, vp = (_Pack.apply(x, rows, cols, flat) for x in (q, k, v))
        o = attnkit.varlen_attention(qp, kp, vp, cu, cu, n, n, causal=c.causal, scale=w.scale)
        return _Unpack.apply(o, rows, cols, gmap, b, n)

    return forward


def paged_cache(w: Workload, wide: bool = False) -> Any:
    """A :class:`attnkit.PagedKVCache` holding the workload's K/V, sequence ids ``0..B-1``, in
    the case's fp8 format if it has one (``wide``: in the workload's dtype regardless).

    Pages are shuffled: the sequences' page-sized chunks are appended in a seeded random
    interleaving, so no sequence owns consecutive pages.
    """
    import attnkit

    c = w.case
    ps = int(c.extra["page_size"])
    chunks = -(-c.lk // ps)
    # an fp8 cache quantizes the workload's K/V on append
    dtype = w.dtype if wide else _fp8_dtype(c) or w.dtype
    cache = attnkit.PagedKVCache(c.batch * chunks, ps, c.hkv, c.d_qk, dtype, v_head_dim=c.dv)
    for b in range(c.batch):
        cache.allocate(b)
    order = torch.randperm(c.batch * chunks, generator=torch.Generator().manual_seed(c.seed))
    owners = torch.arange(c.batch).repeat_interleave(chunks)[order].tolist()
    done = [0] * c.batch
    for b in owners:
        s = slice(done[b] * ps, min((done[b] + 1) * ps, c.lk))
        cache.append(b, w.k[b, :, s].transpose(0, 1).contiguous(),
                     w.v[b, :, s].transpose(0, 1).contiguous())
        done[b] += 1
    return cache


def _fp8_dtype(c: Case) -> Optional[torch.dtype]:
    """The fp8 format of an ``extra={"fp8": "e4m3" | "e5m2"}`` case, else None."""
    fmt = c.extra.get("fp8")
    if fmt is None:
        return None
    formats = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    if fmt not in formats:
        raise ValueError(f"case {c.name!r}: extra['fp8'] must be 'e4m3' or 'e5m2'; got {fmt!r}")
    return formats[fmt]


def _attnkit_fp8(w: Workload, kw: Dict[str, Any]) -> Forward:
    """attention() on the workload's q, k, v quantized once (per head, cuDNN's scale) outside
    the timed call; the call computes in the workload's dtype."""
    import attnkit

    fmt = _fp8_dtype(w.case)

    def quantized() -> tuple:
        return tuple(attnkit.quantize_fp8(x, fmt, "head") for x in (w.q, w.k, w.v))

    (q8, dq), (k8, dk), (v8, dv) = w.cached("fp8_inputs", quantized)

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv,
                                 out_dtype=w.dtype, **kw)

    return forward


def _paged_forward(w: Workload, cache: Any) -> Forward:
    """``paged_attention`` over ``cache`` (sequence ids ``0..B-1``, see :func:`paged_cache`)
    with the case's mask."""
    import attnkit

    ids = list(range(w.case.batch))
    opts: Dict[str, Any] = {"causal": w.case.causal, "diagonal": w.case.diagonal}

    def forward_paged(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attnkit.paged_attention(q, cache, ids, scale=w.scale, **opts)

    return forward_paged


class Attnkit(Peer):
    """:func:`attnkit.attention`, the subject (``varlen_attention`` / ``paged_attention`` for
    the varlen and paged cases)."""

    name = "attnkit"
    label = "attnkit.attention"
    FEATURES = ALL_FEATURES | WORKLOAD_FEATURES | {"fp8"}

    def remarks(self, case: Case, pass_: str) -> List[str]:
        if "fp8" in case.extra and "page_size" not in case.extra:
            return [f"fp8 ({case.extra['fp8']}) q/k/v with per-head descales, dequantized into "
                    f"the compute dtype; err includes the quantization"]
        if "varlen" in case.extra:
            return ["varlen_attention; pack/unpack inside the call"]
        if "page_size" in case.extra:
            from attnkit import native

            fp8 = (f"{case.extra['fp8']} pages (per-page scales; the GB/s note counts 1 byte "
                   f"per element), " if "fp8" in case.extra else "")
            return [f"paged_attention, {fp8}{case.extra['page_size']}-token shuffled pages; "
                    f"{native.describe()}"]
        if "dropout_p" in case.extra:
            return ["replayable dropout; err vs reference with its own keep mask"]
        if case.documents or case.prefix:
            try:
                import attnkit.block_mask  # noqa: F401
            except ImportError:
                return ["mask_mod given (attnkit.block_mask not available)"]
        return []

    def build(self, w: Workload, table: Optional[Tensor]) -> Forward:
        import attnkit

        c = w.case
        if "varlen" in c.extra:
            return _attnkit_varlen(w)
        if "page_size" in c.extra:
            return _paged_forward(w, w.cached("paged_cache", lambda: paged_cache(w)))
        kw = attnkit_kwargs(w, table)
        if "dropout_p" in c.extra:
            kw.update(dropout_p=float(c.extra["dropout_p"]), seed=c.seed)
        if "fp8" in c.extra:
            return _attnkit_fp8(w, kw)

        def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return attnkit.attention(q, k, v, **kw)

        return forward


# --------------------------------------------------------------------------- torch SDPA


@functools.cache
def _sdpa_has_gqa() -> bool:
    import inspect

    import torch.nn.functional as F

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # builtins without a signature: try it
        try:
            x = torch.zeros(1, 2, 1, 4)
            F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
            return True
        except TypeError:
            return False


def _lower_right(c: Case) -> Any:
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:  # older torch: a dense mask does the same
        return None
    return causal_lower_right(c.len_q, c.lk)


def _mask_kind(c: Case) -> str:
    """How the case's visibility reaches SDPA: none, is_causal, lower_right or dense."""
    if c.documents or c.prefix or c.window is not None or c.seqlens():
        return "dense"
    if not c.causal:
        return "none"
    if c.diagonal == "top_left" or c.len_q == c.lk:
        return "is_causal"
    if c.len_q == 1 and c.lk >= 1:  # one query at the bottom-right sees every key
        return "none"
    return "lower_right"


class AttnkitWideCache(Attnkit):
    """The fp8 paged cases' yardstick: attnkit's ``paged_attention`` on the same K/V in a cache
    of the workload's dtype (bfloat16), timed interleaved with the fp8 cache round by round, so
    its ratio to attnkit is the fp8 cache's speedup measured in the same minutes (this VM's
    speed drifts between cases of one run). Add it with ``--peers attnkit,attnkit-wide``."""

    name = "attnkit-wide"
    label = "attnkit, 16-bit cache"

    def supports(self, case: Case, pass_: str) -> List[str]:
        reasons = super().supports(case, pass_)
        if "fp8" not in case.extra or "page_size" not in case.extra:
            reasons.append("runs the fp8 paged cases only (their K/V in a 16-bit cache)")
        return reasons

    def remarks(self, case: Case, pass_: str) -> List[str]:
        return [f"paged_attention over the same K/V in a 16-bit cache of "
                f"{case.extra['page_size']}-token shuffled pages: its ratio is the fp8 cache's "
                f"speedup"]

    def build(self, w: Workload, table: Optional[Tensor]) -> Forward:
        return _paged_forward(w, w.cached("paged_cache_wide", lambda: paged_cache(w, wide=True)))


class Sdpa(Peer):
    """``torch.nn.functional.scaled_dot_product_attention``."""

    name = "sdpa"
    label = "torch SDPA"
    FEATURES = (ALL_FEATURES | WORKLOAD_FEATURES) - {"softcap"}

    def remarks(self, case: Case, pass_: str) -> List[str]:
        kind = _mask_kind(case)
        out = []
        if "page_size" in case.extra:
            out.append("contiguous K/V")
        if "dropout_p" in case.extra:
            out.append("own dropout mask; torch uses its math kernel")
        if case.seqlens():
            out.append("padded batch, dense bool mask (B, 1, L, L)")
        elif case.alibi or case.relative_bias:
            out.append("dense float bias" + (" from the table, in the call"
                                             if case.relative_bias else ""))
        elif kind == "dense":
            out.append("dense bool mask")
        elif kind == "lower_right":
            out.append("causal_lower_right")
        if case.dv != case.d_qk or (case.relative_bias and pass_ == "fwd+bwd"):
            out.append("torch uses its math kernel")
        return out

    def extra_bytes(self, case: Case, pass_: str, dtype: torch.dtype) -> int:
        per_head = case.len_q * case.lk
        pairs = case.batch * case.heads_q * per_head
        n = 0
        float_bias = case.alibi or case.relative_bias
        if _mask_kind(case) == "dense" or (float_bias and case.causal):
            n += per_head  # bool mask
        if case.alibi:
            n += case.heads_q * per_head * _elem(dtype)
        if case.relative_bias:  # int64 index, then gather and where in float32, then cast
            n += per_head * 8 + 2 * case.heads_q * per_head * 4
            if dtype != torch.float32:
                n += case.heads_q * per_head * _elem(dtype)
        if case.seqlens():
            n += case.batch * per_head  # (B, 1, L, L) bool
        math_path = case.dv != case.d_qk or (case.relative_bias and pass_ == "fwd+bwd")
        math_path = math_path or "dropout_p" in case.extra
        if math_path:  # torch falls back to its dense math kernel
            n += (3 if pass_ == "fwd" else 6) * pairs * 4
        return n

    def build(self, w: Workload, table: Optional[Tensor]) -> Forward:
        import torch.nn.functional as F

        c = w.case
        kind = _mask_kind(c)
        gqa = c.hkv != c.heads_q
        native_gqa = gqa and _sdpa_has_gqa()
        groups = c.heads_q // c.hkv
        opts: Dict[str, Any] = {"scale": w.scale}
        if native_gqa:
            opts["enable_gqa"] = True
        if "dropout_p" in c.extra:
            opts["dropout_p"] = float(c.extra["dropout_p"])
        float_bias = c.alibi or c.relative_bias
        static: Any = None  # mask or bias built once, outside the timing
        rows_ok: Optional[Tensor] = None
        if c.seqlens():
            from .flops import padded_rows, padded_visibility

            static = w.cached("sdpa_padded_mask", lambda: padded_visibility(c))
            rows_ok = padded_rows(c)
        elif not float_bias:
            if kind == "is_causal":
                opts["is_causal"] = True
            elif kind == "lower_right":
                static = w.cached("sdpa_lower_right", lambda: _lower_right(c))
                if static is None:
                    static = w.visible()
            elif kind == "dense":
                static = w.visible()
        vis = w.visible() if float_bias and kind != "none" else None
        if c.alibi:
            def build_alibi() -> Tensor:
                bias = alibi_bias(c, w.slopes).unsqueeze(0)
                if vis is not None and not c.relative_bias:
                    bias = bias.masked_fill(~vis, float("-inf"))
                return bias.to(w.dtype)

            static = w.cached("sdpa_alibi", build_alibi)
        index = w.cached("relative_index", lambda: relative_index(c)) if c.relative_bias else None

        def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if gqa and not native_gqa:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            mask = static
            if index is not None:
                bias = table[:, index]  # (Hq, Lq, Lk), differentiable in the table
                if vis is not None:
                    bias = torch.where(vis, bias, float("-inf"))
                bias = bias.to(q.dtype).unsqueeze(0)
                mask = bias if static is None else bias + static
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **opts)
            if rows_ok is not None:  # padding query rows: 0, as attnkit gives
                out = out.masked_fill(~rows_ok, 0.0)
            return out

        return forward


# --------------------------------------------------------------------------- FlexAttention


def _flex_mods(w: Workload, table: Optional[Tensor]) -> tuple:
    """(mask_mod or None, score_mod or None), written the way a FlexAttention user writes them."""
    c = w.case
    off = c.offset
    mask_mod = None
    if c.prefix:
        prefix = c.prefix

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx <= q_idx) | (kv_idx < prefix)
    elif c.causal or c.window is not None or c.documents:
        left, right = c.window if c.window is not None else (None, None)
        causal = c.causal
        doc_ids = None
        if c.documents:
            lengths = torch.tensor(c.doc_lengths())
            doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            ok = kv_idx >= 0
            if causal:
                ok = ok & (kv_idx <= q_idx + off)
            if left is not None:
                ok = ok & (kv_idx >= q_idx + off - left)
            if right is not None:
                ok = ok & (kv_idx <= q_idx + off + right)
            if doc_ids is not None:
                ok = ok & (doc_ids[q_idx] == doc_ids[kv_idx])
            return ok

    cap = c.softcap
    slopes = w.slopes if c.alibi else None
    tab = table if c.relative_bias else None
    m = c.max_distance
    if cap is None and slopes is None and tab is None:
        return mask_mod, None

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - (slopes[h] * (q_idx + off - kv_idx).abs()).to(score.dtype)
        if tab is not None:
            score = score + tab[h, kv_idx - q_idx + m - 1].to(score.dtype)
        return score

    return mask_mod, score_mod


def _flex_block_mask(w: Workload, mask_mod: Any) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    c = w.case
    return w.cached("flex_block_mask", lambda: create_block_mask(
        mask_mod, None, None, c.len_q, c.lk, device="cpu"))


class Flex(Peer):
    """torch FlexAttention in eager mode (materialises the scores)."""

    name = "flex"
    label = "torch flex (eager)"
    FEATURES = ALL_FEATURES
    backward = False
    no_backward_reason = "fwd only: torch flex has no CPU backward"
    max_rounds = 2

    def extra_bytes(self, case: Case, pass_: str, dtype: torch.dtype) -> int:
        return 4 * case.pairs * 4  # scores, mods, exp and probabilities, float32

    def _function(self) -> Callable[..., Tensor]:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention

    def build(self, w: Workload, table: Optional[Tensor]) -> Forward:
        c = w.case
        mask_mod, score_mod = _flex_mods(w, table)
        block_mask = _flex_block_mask(w, mask_mod) if mask_mod is not None else None
        fn = self._function()
        gqa = c.hkv != c.heads_q

        def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            with warnings.catch_warnings():  # eager mode warns that it is eager
                warnings.simplefilter("ignore", UserWarning)
                return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=w.scale,
                          enable_gqa=gqa)

        return forward


class FlexCompiled(Flex):
    """torch FlexAttention under ``torch.compile`` (a fused C++ kernel on CPU)."""

    name = "flex_compiled"
    label = "torch flex (compiled)"
    compiled = True
    max_rounds = None

    def extra_bytes(self, case: Case, pass_: str, dtype: torch.dtype) -> int:
        return 0

    def _function(self) -> Callable[..., Tensor]:
        from torch.nn.attention.flex_attention import flex_attention

        # A fresh compile per case: stale graphs of earlier cases would otherwise pile up to
        # dynamo's recompile limit, past which it silently runs eager.
        torch._dynamo.reset()
        return torch.compile(flex_attention, dynamic=False)


# --------------------------------------------------------------------------- compiled calls


def _compiled(forward: Forward) -> Forward:
    """``forward`` under ``torch.compile(fullgraph=True)``, compiled afresh for this case
    (stale graphs of earlier cases would pile up to dynamo's recompile limit)."""
    torch._dynamo.reset()
    return torch.compile(forward, fullgraph=True, dynamic=False)


class _Compiled:
    """A peer's call inside ``torch.compile(fullgraph=True)`` (mixed in before the peer)."""

    compiled = True

    def build(self, w: Workload, table: Optional[Tensor]) -> Forward:
        return _compiled(super().build(w, table))  # type: ignore[misc]


class AttnkitCompiled(_Compiled, Attnkit):
    """:func:`attnkit.attention` compiled (one ``attnkit::attention`` op in the graph)."""

    name = "attnkit_compiled"
    label = "attnkit (compiled)"
    FEATURES = Attnkit.FEATURES - {"fp8"}  # (fp8 runs outside the compiled graph)

    def remarks(self, case: Case, pass_: str) -> List[str]:
        return ["torch.compile(fullgraph=True): the attnkit::attention op"]


class SdpaCompiled(_Compiled, Sdpa):
    """torch SDPA compiled."""

    name = "sdpa_compiled"
    label = "torch SDPA (compiled)"


# --------------------------------------------------------------------------- naive


class Naive(Peer):
    """Textbook attention with the scores materialised in the input dtype."""

    name = "naive"
    label = "naive dense"
    FEATURES = ALL_FEATURES
    max_rounds = 2

    def extra_bytes(self, case: Case, pass_: str, dtype: torch.dtype) -> int:
        pairs = case.pairs
        n = case.len_q * case.lk  # bool mask
        steps = 2 + (case.softcap is not None) + case.alibi + case.relative_bias
        if case.alibi:
            n += case.heads_q * case.len_q * case.lk * _elem(dtype)
        if case.relative_bias:
            n += case.heads_q * case.len_q * case.lk * 4
        live = 3 if pass_ == "fwd" else steps + 4
        return n + live * pairs * _elem(dtype)

    def build(self, w: Workload, table: Optional[Tensor]) -> Forward:
        c = w.case
        vis = w.visible()
        bias = w.cached("naive_alibi", lambda: alibi_bias(c, w.slopes).to(w.dtype)) \
            if c.alibi else None
        index = w.cached("relative_index", lambda: relative_index(c)) if c.relative_bias else None

        def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return dense_attention(q, k, v, scale=w.scale, visible=vis, softcap=c.softcap,
                                   bias=bias, table=table, table_index=index)

        return forward


# --------------------------------------------------------------------------- registry

PEERS: Dict[str, Peer] = {p.name: p for p in (Attnkit(), Sdpa(), Flex(), FlexCompiled(), Naive(),
                                                AttnkitCompiled(), SdpaCompiled(),
                                                AttnkitWideCache())}
"""Every peer by name, the subject (``attnkit``) first."""

SUBJECT = "attnkit"


def make_call(peer: Peer, w: Workload, pass_: str) -> Callable[[], Any]:
    """The timed callable of ``peer`` for ``pass_``.

    ``fwd``: ``forward(q, k, v)`` under ``torch.no_grad()`` (inference), returns ``out``.
    ``fwd+bwd``: forward on leaves that require grad, then the gradients of ``sum(out * g)``
    for q, k, v (and the relative-bias table); returns ``(out, grads)``.
    """
    if pass_ == "fwd":
        fwd = peer.build(w, w.table)

        def call_fwd() -> Tensor:
            with torch.no_grad():
                return fwd(w.q, w.k, w.v)

        return call_fwd
    if pass_ != "fwd+bwd":
        raise ValueError(f"pass must be 'fwd' or 'fwd+bwd'; got {pass_!r}")
    leaves = [w.q.detach().clone().requires_grad_(), w.k.detach().clone().requires_grad_(),
              w.v.detach().clone().requires_grad_()]
    table = None
    if w.table is not None:
        table = w.table.detach().clone().requires_grad_()
        leaves.append(table)
    fwd = peer.build(w, table)
    g = w.g

    def call_bwd() -> tuple:
        out = fwd(leaves[0], leaves[1], leaves[2])
        grads = torch.autograd.grad(out, leaves, g)
        return out.detach(), grads

    return call_bwd
