"""Triton kernels of the triton executor: the only attnkit module that imports triton.

Four kernels, each launched by one function of the same name without the underscore
(``attn_fwd``, ``attn_merge``, ``attn_bwd_dq``, ``attn_bwd_dkdv``), so that each launch can be
wrapped on its own later:

- ``_attn_fwd``: one program per (query block, batch row, head group, key split). A program
  holds ``HG`` query heads (1 for prefill; all ``G`` heads of a key/value head for decoding,
  their rows stacked) times ``BQ`` query positions, and walks the key blocks the plan lists
  for its query block with an online softmax. Without a split it writes out, LSE and row
  maxima; with one it writes its partial accumulator, max and sum for ``_attn_merge``.
- ``_attn_merge``: combines the partial (acc, m, l) of the key splits of one program row.
- ``_attn_bwd_dq``: one program per (query block, batch row, query head): dQ.
- ``_attn_bwd_dkdv``: one program per (key block, batch row, key/value head): dK, dV and
  dBias, looping over the query blocks the plan lists for its key block and over the ``G``
  query heads of its key/value head. Every output element is written by one program, so the
  backward is deterministic (no atomics).

Tiles come from the plan as int tables: the key blocks of each query block (and the transpose
for dK/dV), each tile's kind (1 partial: evaluate the mask terms; 2 full: skip them) and, for
tiles a mask_mod or BlockMask cuts, a slot in a buffer of pre-evaluated tile masks. Every score
term is a constexpr branch of :func:`_score_tile`, which all three kernels call.

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU
tensors; ``UPCAST`` then casts matmul operands to float32 (the interpreter's ``tl.dot`` on
bfloat16 would multiply bit patterns).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRET", "attn_fwd", "attn_merge", "attn_bwd_dq", "attn_bwd_dkdv"]

# ---- device helpers ---------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    """tanh in float32: an odd polynomial near 0 (no cancellation), (1 - e) / (1 + e) with
    e = exp(-2|x|) elsewhere; exact limits at +-inf."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0, -big, big)
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                                                         - x2 * 0.05396825396825397)))
    return tl.where(ax < 0.125, small, big)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """a @ b with a float32 result (operands cast to float32 when interpreting)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _r(x, TR: tl.constexpr):
    """A per-query vector as a tile axis: rows, or columns of a transposed (key-major) tile."""
    if TR:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _c(x, TR: tl.constexpr):
    """A per-key vector as a tile axis: columns, or rows of a transposed tile."""
    if TR:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _philox_keep(seed_lo, seed_hi, offset, b, h_r, i_r, j, threshold, TR: tl.constexpr):
    """Dropout keep mask of the tile: Philox-4x32-10 with counter (16 * (j // 64) + j % 16,
    i, h + b * 2**16, offset) and key (seed lo, seed hi), key column j taking word
    (j // 16) % 4; kept iff (word >> 8) >= threshold (the same bits as
    attnkit.dropout.keep_mask)."""
    zero = _r(i_r, TR).to(tl.uint32) * 0 + _c(j, TR).to(tl.uint32) * 0
    jw = zero + _c(j, TR).to(tl.uint32)
    c0 = ((jw >> 6) << 4) | (jw & 15)
    word = (jw >> 4) & 3
    c1 = zero + _r(i_r, TR).to(tl.uint32)
    c2 = zero + _r(h_r.to(tl.uint32) + b.to(tl.uint32) * 65536, TR)
    c3 = zero + offset.to(tl.uint32)
    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    for _ in tl.static_range(10):
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        c0 = hi1 ^ c1 ^ k0
        c2 = hi0 ^ c3 ^ k1
        c1 = lo1
        c3 = lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    x = tl.where(word == 0, c0, tl.where(word == 1, c1, tl.where(word == 2, c2, c3)))
    return (x >> 8) >= threshold.to(tl.uint32)


@triton.jit
def _offsets(b, h_r, i_r, j, sb, sh, sm, sn, TR: tl.constexpr):
    """int64 offsets of a (batch, head, query, key) tensor read with strides over the tile."""
    return (b.to(tl.int64) * sb + _r(h_r.to(tl.int64) * sh + i_r.to(tl.int64) * sm, TR)
            + _c(j.to(tl.int64) * sn, TR))


@triton.jit
def _score_tile(qk, b, h_r, i_r, ip_r, rv, j, cv, sq_b, sk_b, partial, slot, q0, k0,
                Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, TMask, stt, stb, sth,
                Slopes, ssb, ssh, ssm, Rel, srh, rel_off, SegQ, SegK, softcap, left, right,
                SOFTCAP: tl.constexpr, BIAS: tl.constexpr, ALIBI: tl.constexpr,
                REL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr, SEGMENTS: tl.constexpr,
                MASK: tl.constexpr, TMASK: tl.constexpr, BLOCK_N: tl.constexpr,
                TR: tl.constexpr, BOUNDS: tl.constexpr):
    """The final score tile of queries (h_r, i_r) and keys j from ``qk`` (q.k times scale,
    or times scale / softcap): softcap, bias, ALiBi, the relative table, then the mask terms
    on partial tiles (``partial``); hidden pairs are -inf. Also returns tanh of the capped
    scores (for the backward; ``qk`` itself without a softcap). ``TR``: the tile is
    key-major (keys down, queries across). ``BOUNDS``: keys past the end are -inf (the
    forward; the backward needs no bounds: rows past the end have lse = +inf, so P = 0, and
    keys past the end are zero rows of K and V whose gradients are not stored)."""
    s = qk
    th = qk
    if SOFTCAP:
        th = _tanh(qk)
        s = th * softcap
    if BIAS:
        boff = _offsets(b, h_r, i_r, j, sbb, sbh, sbm, sbn, TR)
        s += tl.load(Bias + boff, mask=_r(rv, TR) & _c(cv, TR), other=0.0).to(tl.float32)
    if ALIBI:
        slope = tl.load(Slopes + b * ssb + h_r * ssh + i_r * ssm, mask=rv, other=0.0)
        s -= _r(slope, TR) * tl.abs(_r(ip_r, TR) - _c(j, TR)).to(tl.float32)
    if REL:
        roff = _r(h_r * srh - i_r + rel_off, TR) + _c(j, TR)
        s += tl.load(Rel + roff, mask=_r(rv, TR) & _c(cv, TR), other=0.0)
    if BOUNDS:
        s += _c(tl.where(cv, 0.0, float("-inf")), TR)
    if LEFT or RIGHT or SEQ_Q or SEQ_K or SEGMENTS or MASK or TMASK:
        if partial:
            inb = _r(rv, TR) & _c(cv, TR)
            vis = inb
            if LEFT:
                vis = vis & (_c(j, TR) >= _r(ip_r - left, TR))
            if RIGHT:
                vis = vis & (_c(j, TR) <= _r(ip_r + right, TR))
            if SEQ_Q:
                vis = vis & _r(i_r < sq_b, TR)
            if SEQ_K:
                vis = vis & _c(j < sk_b, TR)
            if SEGMENTS:
                seg_q = tl.load(SegQ + i_r, mask=rv, other=-1)
                seg_k = tl.load(SegK + j, mask=cv, other=-2)
                vis = vis & (_r(seg_q, TR) == _c(seg_k, TR))
            if MASK:
                moff = _offsets(b, h_r, i_r, j, smb, smh, smm, smn, TR)
                vis = vis & (tl.load(Mask + moff, mask=inb, other=0) != 0)
            if TMASK:
                if slot >= 0:
                    toff = (slot.to(tl.int64) * stt + b * stb
                            + _r(h_r * sth + (i_r - q0) * BLOCK_N, TR) + _c(j - k0, TR))
                    vis = vis & (tl.load(TMask + toff, mask=inb, other=0) != 0)
            s = tl.where(vis, s, float("-inf"))
    return s, th


@triton.jit
def _dropped(p, b, h_r, i_r, j, rv, cv, Keep, skb, skh, skm, skn, seed_lo, seed_hi,
             drop_off, drop_thr, drop_scale, DROPOUT: tl.constexpr, KEEP: tl.constexpr,
             TR: tl.constexpr):
    """``p`` times the dropout multiplier (keep / (1 - p)) of the tile."""
    if DROPOUT:
        keep = _philox_keep(seed_lo, seed_hi, drop_off, b, h_r, i_r, j, drop_thr, TR)
        p = tl.where(keep, p * drop_scale, 0.0)
    if KEEP:
        koff = _offsets(b, h_r, i_r, j, skb, skh, skm, skn, TR)
        keep = tl.load(Keep + koff, mask=_r(rv, TR) & _c(cv, TR), other=0) != 0
        p = tl.where(keep, p * drop_scale, 0.0)
    return p


@triton.jit
def _kv_rows(b, j, ok, BT, sbt, page_size, spage, stok, sn, PAGED: tl.constexpr):
    """Offsets of key rows j: through the block table when paged, else j * stride."""
    if PAGED:
        page = tl.load(BT + b.to(tl.int64) * sbt + j // page_size, mask=ok, other=0)
        return page.to(tl.int64) * spage + (j % page_size).to(tl.int64) * stok
    else:
        return j * sn


@triton.jit
def _finish(acc, m, l, h_r, rv, Sinks, SINKS: tl.constexpr):
    """Normalise one row block: (out, lse). Rows without a visible key give out 0 and lse
    -inf (with sinks: lse = sink)."""
    if SINKS:
        sink = tl.load(Sinks + h_r, mask=rv, other=0.0).to(tl.float32)
        top = tl.maximum(m, sink)
        w = tl.exp(m - top)
        total = l * w + tl.exp(sink - top)
        o = acc * (w / total)[:, None]
        lse = top + tl.log(total)
    else:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l_safe = tl.where(l > 0, l, 1.0)
        lse = tl.where(l > 0, m_safe + tl.log(l_safe), float("-inf"))
        o = acc * tl.where(l > 0, 1.0 / l_safe, 0.0)[:, None]
    return o, lse


# ---- forward ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "drop_off", "drop_thr"])
def _attn_fwd(Q, K, V, O, Lse, Mx, PartO, PartML,
              sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
              KvList, KvCnt, Kind, Slot, list_stride, nkb, per_split, n_split,
              BT, sbt, page_size, spk, stk, spv, stv,
              SeqQ, SeqK, RowOff,
              Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, TMask, stt, stb, sth,
              Slopes, ssb, ssh, ssm, Rel, srh, rel_off, SegQ, SegK, softcap, left, right,
              Sinks, Keep, skpb, skph, skpm, skpn, seed_lo, seed_hi, drop_off, drop_thr,
              drop_scale, qscale, Lq, Lk, Hq, G, n_groups, nqb,
              DQK: tl.constexpr, DV: tl.constexpr, BQ: tl.constexpr, HG: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr, BIAS: tl.constexpr,
              ALIBI: tl.constexpr, REL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
              SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr, SEGMENTS: tl.constexpr,
              MASK: tl.constexpr, TMASK: tl.constexpr, ROW_OFF: tl.constexpr,
              DIAG_BR: tl.constexpr, DROPOUT: tl.constexpr, KEEP: tl.constexpr,
              SINKS: tl.constexpr, SPLIT: tl.constexpr, MAXS: tl.constexpr,
              PAGED: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    qb = nqb - 1 - tl.program_id(0)  # longest rows (causal) first
    pid1 = tl.program_id(1)
    split = tl.program_id(2)
    b = pid1 // n_groups
    hg = pid1 % n_groups
    r = tl.arange(0, BLOCK_M)
    q0 = qb * BQ
    i_r = q0 + r % BQ
    h_r = hg * HG + r // BQ
    rv = (r < HG * BQ) & (i_r < Lq)
    hkv = (hg * HG) // G
    sq_b = Lq
    sk_b = Lk
    if SEQ_Q:
        sq_b = tl.load(SeqQ + b)
    if SEQ_K:
        sk_b = tl.load(SeqK + b)
    ip_r = i_r
    if DIAG_BR:
        ip_r = ip_r + (sk_b - sq_b)
    if ROW_OFF:
        ip_r = ip_r + tl.load(RowOff + i_r, mask=rv, other=0)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ok = rv
    if SEQ_Q:
        q_ok = q_ok & (i_r < sq_b)
    qoff = (h_r * sqh + i_r * sqm)[:, None] + d[None, :]
    q = tl.load(Q + b.to(tl.int64) * sqb + qoff, mask=q_ok[:, None] & (d[None, :] < DQK),
                other=0.0)
    kbase = K + b.to(tl.int64) * skb + hkv.to(tl.int64) * skh
    vbase = V + b.to(tl.int64) * svb + hkv.to(tl.int64) * svh

    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    cnt = tl.load(KvCnt + qb)
    lo = split * per_split
    hi = tl.minimum(cnt, lo + per_split)
    for t in range(lo, hi):
        kb = tl.load(KvList + qb * list_stride + t)
        partial = tl.load(Kind + qb * nkb + kb) == 1
        slot = -1
        if TMASK:
            slot = tl.load(Slot + qb * nkb + kb)
        k0 = kb * BLOCK_N
        j = k0 + tl.arange(0, BLOCK_N)
        cv = j < Lk
        kv_ok = cv
        if SEQ_K:
            kv_ok = kv_ok & (j < sk_b)
        krow = _kv_rows(b, j, kv_ok, BT, sbt, page_size, spk, stk, skn, PAGED)
        kt = tl.load(kbase + krow[None, :] + d[:, None],
                     mask=kv_ok[None, :] & (d[:, None] < DQK), other=0.0)
        qk = _dot(q, kt, UPCAST, PREC) * qscale
        s, _th = _score_tile(qk, b, h_r, i_r, ip_r, rv, j, cv, sq_b, sk_b, partial, slot,
                             q0, k0, Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn,
                             TMask, stt, stb, sth, Slopes, ssb, ssh, ssm, Rel, srh, rel_off,
                             SegQ, SegK, softcap, left, right, SOFTCAP, BIAS, ALIBI, REL,
                             LEFT, RIGHT, SEQ_Q, SEQ_K, SEGMENTS, MASK, TMASK, BLOCK_N, False, True)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        p = _dropped(p, b, h_r, i_r, j, rv, cv, Keep, skpb, skph, skpm, skpn, seed_lo,
                     seed_hi, drop_off, drop_thr, drop_scale, DROPOUT, KEEP, False)
        vrow = _kv_rows(b, j, kv_ok, BT, sbt, page_size, spv, stv, svn, PAGED)
        vt = tl.load(vbase + vrow[:, None] + dv[None, :],
                     mask=kv_ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, UPCAST, PREC)
        m = m_new

    if SPLIT:
        base = ((pid1 * nqb + qb) * n_split + split).to(tl.int64)
        tl.store(PartO + (base * BLOCK_M + r[:, None]) * BLOCK_DV + dv[None, :], acc)
        tl.store(PartML + (base * 2) * BLOCK_M + r, m)
        tl.store(PartML + (base * 2 + 1) * BLOCK_M + r, l)
    else:
        o, lse = _finish(acc, m, l, h_r, rv, Sinks, SINKS)
        ooff = (h_r * soh + i_r * som)[:, None] + dv[None, :]
        tl.store(O + b.to(tl.int64) * sob + ooff, o.to(O.dtype.element_ty),
                 mask=rv[:, None] & (dv[None, :] < DV))
        roff = (b.to(tl.int64) * Hq + h_r) * Lq + i_r
        tl.store(Lse + roff, lse, mask=rv)
        if MAXS:
            tl.store(Mx + roff, m, mask=rv)


@triton.jit
def _attn_merge(O, Lse, Mx, PartO, PartML, sob, soh, som, Sinks, Lq, Hq, n_groups, nqb,
                n_split, DV: tl.constexpr, BQ: tl.constexpr, HG: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, SINKS: tl.constexpr,
                MAXS: tl.constexpr):
    qb = tl.program_id(0)
    pid1 = tl.program_id(1)
    b = pid1 // n_groups
    hg = pid1 % n_groups
    r = tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    i_r = qb * BQ + r % BQ
    h_r = hg * HG + r // BQ
    rv = (r < HG * BQ) & (i_r < Lq)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    for s in range(0, n_split):
        base = ((pid1 * nqb + qb) * n_split + s).to(tl.int64)
        m_s = tl.load(PartML + (base * 2) * BLOCK_M + r)
        l_s = tl.load(PartML + (base * 2 + 1) * BLOCK_M + r)
        a_s = tl.load(PartO + (base * BLOCK_M + r[:, None]) * BLOCK_DV + dv[None, :])
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_old = tl.exp(m - m_safe)
        w_new = tl.exp(m_s - m_safe)
        l = l * w_old + l_s * w_new
        acc = acc * w_old[:, None] + a_s * w_new[:, None]
        m = m_new
    o, lse = _finish(acc, m, l, h_r, rv, Sinks, SINKS)
    ooff = (h_r * soh + i_r * som)[:, None] + dv[None, :]
    tl.store(O + b.to(tl.int64) * sob + ooff, o.to(O.dtype.element_ty),
             mask=rv[:, None] & (dv[None, :] < DV))
    roff = (b.to(tl.int64) * Hq + h_r) * Lq + i_r
    tl.store(Lse + roff, lse, mask=rv)
    if MAXS:
        tl.store(Mx + roff, m, mask=rv)


# ---- backward ---------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "drop_off", "drop_thr"])
def _attn_bwd_dq(Q, K, V, DO, LseS, Delta, DQ,
                 sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
                 KvList, KvCnt, Kind, Slot, list_stride, nkb,
                 SeqQ, SeqK, RowOff,
                 Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, TMask, stt, stb, sth,
                 Slopes, ssb, ssh, ssm, Rel, srh, rel_off, SegQ, SegK, softcap, left, right,
                 Keep, skpb, skph, skpm, skpn, seed_lo, seed_hi, drop_off, drop_thr,
                 drop_scale, qscale, dscale, Lq, Lk, Hq, G,
                 DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 SOFTCAP: tl.constexpr, BIAS: tl.constexpr, ALIBI: tl.constexpr,
                 REL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                 SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr, SEGMENTS: tl.constexpr,
                 MASK: tl.constexpr, TMASK: tl.constexpr, ROW_OFF: tl.constexpr,
                 DIAG_BR: tl.constexpr, DROPOUT: tl.constexpr, KEEP: tl.constexpr,
                 UPCAST: tl.constexpr, PREC: tl.constexpr):
    qb = tl.program_id(0)
    pid1 = tl.program_id(1)
    b = pid1 // Hq
    h = pid1 % Hq
    hkv = h // G
    r = tl.arange(0, BLOCK_M)
    q0 = qb * BLOCK_M
    i_r = q0 + r
    h_r = tl.zeros((BLOCK_M,), dtype=tl.int32) + h
    rv = i_r < Lq
    sq_b = Lq
    sk_b = Lk
    if SEQ_Q:
        sq_b = tl.load(SeqQ + b)
    if SEQ_K:
        sk_b = tl.load(SeqK + b)
    ip_r = i_r
    if DIAG_BR:
        ip_r = ip_r + (sk_b - sq_b)
    if ROW_OFF:
        ip_r = ip_r + tl.load(RowOff + i_r, mask=rv, other=0)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ok = rv
    if SEQ_Q:
        q_ok = q_ok & (i_r < sq_b)
    qbase = Q + (b.to(tl.int64) * sqb + h.to(tl.int64) * sqh)
    q = tl.load(qbase + (i_r[:, None] * sqm + d[None, :]),
                mask=q_ok[:, None] & (d[None, :] < DQK), other=0.0)
    dobase = DO + (b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh)
    do = tl.load(dobase + (i_r[:, None] * sdom + dv[None, :]),
                 mask=q_ok[:, None] & (dv[None, :] < DV), other=0.0)
    roff = (b.to(tl.int64) * Hq + h) * Lq + i_r
    lse = tl.load(LseS + roff, mask=rv, other=float("inf"))
    delta = tl.load(Delta + roff, mask=rv, other=0.0)
    kbase = K + b.to(tl.int64) * skb + hkv.to(tl.int64) * skh
    vbase = V + b.to(tl.int64) * svb + hkv.to(tl.int64) * svh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    cnt = tl.load(KvCnt + qb)
    for t in range(0, cnt):
        kb = tl.load(KvList + qb * list_stride + t)
        partial = tl.load(Kind + qb * nkb + kb) == 1
        slot = -1
        if TMASK:
            slot = tl.load(Slot + qb * nkb + kb)
        k0 = kb * BLOCK_N
        j = k0 + tl.arange(0, BLOCK_N)
        cv = j < Lk
        kv_ok = cv
        if SEQ_K:
            kv_ok = kv_ok & (j < sk_b)
        kk = tl.load(kbase + (j[:, None] * skn + d[None, :]),
                     mask=kv_ok[:, None] & (d[None, :] < DQK), other=0.0)
        vt = tl.load(vbase + (j[None, :] * svn + dv[:, None]),
                     mask=kv_ok[None, :] & (dv[:, None] < DV), other=0.0)
        qk = _dot(q, tl.trans(kk), UPCAST, PREC) * qscale
        s, th = _score_tile(qk, b, h_r, i_r, ip_r, rv, j, cv, sq_b, sk_b, partial, slot,
                            q0, k0, Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn,
                            TMask, stt, stb, sth, Slopes, ssb, ssh, ssm, Rel, srh, rel_off,
                            SegQ, SegK, softcap, left, right, SOFTCAP, BIAS, ALIBI, REL,
                            LEFT, RIGHT, SEQ_Q, SEQ_K, SEGMENTS, MASK, TMASK, BLOCK_N, False, True)
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, vt, UPCAST, PREC)
        dp = _dropped(dp, b, h_r, i_r, j, rv, cv, Keep, skpb, skph, skpm, skpn, seed_lo,
                      seed_hi, drop_off, drop_thr, drop_scale, DROPOUT, KEEP, False)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - th * th)
        dq += _dot(ds.to(kk.dtype), kk, UPCAST, PREC)
    tl.store(DQ + (roff[:, None] * DQK + d[None, :]), dq * dscale,
             mask=rv[:, None] & (d[None, :] < DQK))


@triton.jit
def _store_dbias(tile, DB, b, hb, i_r, j, qb, kb, rv, cv, sdb_b, sdb_h, sdb_m, sdb_n,
                 DB_Q: tl.constexpr, DB_K: tl.constexpr):
    """Write one key-major tile (keys down, queries across) of dS into the bias-gradient
    buffer, summed over the bias's broadcast query (DB_Q false) or key (DB_K false) dim: the
    buffer then holds one column per key block or one row per query block, which the host
    sums."""
    base = DB + b.to(tl.int64) * sdb_b + hb.to(tl.int64) * sdb_h
    if DB_Q:
        if DB_K:
            off = i_r[None, :].to(tl.int64) * sdb_m + j[:, None].to(tl.int64) * sdb_n
            tl.store(base + off, tile, mask=rv[None, :] & cv[:, None])
        else:
            tl.store(base + i_r.to(tl.int64) * sdb_m + kb * sdb_n, tl.sum(tile, 0), mask=rv)
    else:
        if DB_K:
            tl.store(base + qb * sdb_m + j.to(tl.int64) * sdb_n, tl.sum(tile, 1), mask=cv)
        else:
            tl.store(base + qb * sdb_m + kb * sdb_n, tl.sum(tl.sum(tile, 1), 0))


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "drop_off", "drop_thr"])
def _attn_bwd_dkdv(Q, K, V, DO, LseS, Delta, DK, DV_, DB,
                   sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
                   sdb_b, sdb_h, sdb_m, sdb_n,
                   QList, QCnt, Kind, Slot, qlist_stride, nkb,
                   SeqQ, SeqK, RowOff,
                   Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, TMask, stt, stb, sth,
                   Slopes, ssb, ssh, ssm, Rel, srh, rel_off, SegQ, SegK, softcap, left, right,
                   Keep, skpb, skph, skpm, skpn, seed_lo, seed_hi, drop_off, drop_thr,
                   drop_scale, qscale, dscale, Lq, Lk, Hq, Hkv, G,
                   DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   SOFTCAP: tl.constexpr, BIAS: tl.constexpr, ALIBI: tl.constexpr,
                   REL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                   SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr, SEGMENTS: tl.constexpr,
                   MASK: tl.constexpr, TMASK: tl.constexpr, ROW_OFF: tl.constexpr,
                   DIAG_BR: tl.constexpr, DROPOUT: tl.constexpr, KEEP: tl.constexpr,
                   DBIAS: tl.constexpr, DB_HB: tl.constexpr, DB_Q: tl.constexpr,
                   DB_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    # key-major tiles throughout: S^T (BLOCK_N keys x BLOCK_M queries), so dK and dV
    # accumulate from products whose rows are this program's keys
    kb = tl.program_id(0)
    pid1 = tl.program_id(1)
    b = pid1 // Hkv
    hkv = pid1 % Hkv
    k0 = kb * BLOCK_N
    j = k0 + tl.arange(0, BLOCK_N)
    cv = j < Lk
    sq_b = Lq
    sk_b = Lk
    if SEQ_Q:
        sq_b = tl.load(SeqQ + b)
    if SEQ_K:
        sk_b = tl.load(SeqK + b)
    kv_ok = cv
    if SEQ_K:
        kv_ok = kv_ok & (j < sk_b)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    kk = tl.load(K + (b.to(tl.int64) * skb + hkv.to(tl.int64) * skh)
                 + (j[:, None] * skn + d[None, :]),
                 mask=kv_ok[:, None] & (d[None, :] < DQK), other=0.0)
    vv = tl.load(V + (b.to(tl.int64) * svb + hkv.to(tl.int64) * svh)
                 + (j[:, None] * svn + dv[None, :]),
                 mask=kv_ok[:, None] & (dv[None, :] < DV), other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dvacc = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    r = tl.arange(0, BLOCK_M)
    dbt = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # one flat loop over (query block, query head of this key/value head), heads inner
    steps = tl.load(QCnt + kb) * G
    for t in range(0, steps):
        qb = tl.load(QList + kb * qlist_stride + t // G)
        g = t % G
        h = hkv * G + g
        partial = tl.load(Kind + qb * nkb + kb) == 1
        slot = -1
        if TMASK:
            slot = tl.load(Slot + qb * nkb + kb)
        q0 = qb * BLOCK_M
        i_r = q0 + r
        rv = i_r < Lq
        q_ok = rv
        if SEQ_Q:
            q_ok = q_ok & (i_r < sq_b)
        ip_r = i_r
        if DIAG_BR:
            ip_r = ip_r + (sk_b - sq_b)
        if ROW_OFF:
            ip_r = ip_r + tl.load(RowOff + i_r, mask=rv, other=0)
        h_r = tl.zeros((BLOCK_M,), dtype=tl.int32) + h
        qt = tl.load(Q + (b.to(tl.int64) * sqb + h.to(tl.int64) * sqh)
                     + (i_r[None, :] * sqm + d[:, None]),
                     mask=q_ok[None, :] & (d[:, None] < DQK), other=0.0)
        do = tl.load(DO + (b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh)
                     + (i_r[:, None] * sdom + dv[None, :]),
                     mask=q_ok[:, None] & (dv[None, :] < DV), other=0.0)
        roff = (b.to(tl.int64) * Hq + h) * Lq + i_r
        lse = tl.load(LseS + roff, mask=rv, other=float("inf"))
        delta = tl.load(Delta + roff, mask=rv, other=0.0)
        qk = _dot(kk, qt, UPCAST, PREC) * qscale
        s, th = _score_tile(qk, b, h_r, i_r, ip_r, rv, j, cv, sq_b, sk_b, partial, slot,
                            q0, k0, Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn,
                            TMask, stt, stb, sth, Slopes, ssb, ssh, ssm, Rel, srh,
                            rel_off, SegQ, SegK, softcap, left, right, SOFTCAP, BIAS,
                            ALIBI, REL, LEFT, RIGHT, SEQ_Q, SEQ_K, SEGMENTS, MASK, TMASK,
                            BLOCK_N, True, False)
        p = tl.exp(s - lse[None, :])
        pd = p
        dp = _dot(vv, tl.trans(do), UPCAST, PREC)
        if DROPOUT or KEEP:  # one multiplier tile for P and dP
            mult = _dropped(tl.full(p.shape, 1.0, tl.float32), b, h_r, i_r, j, rv, cv, Keep,
                            skpb, skph, skpm, skpn, seed_lo, seed_hi, drop_off, drop_thr,
                            drop_scale, DROPOUT, KEEP, True)
            pd = p * mult
            dp = dp * mult
        dvacc += _dot(pd.to(do.dtype), do, UPCAST, PREC)
        ds = p * (dp - delta[None, :])
        if DBIAS:
            ds = tl.where(cv[:, None], ds, 0.0)  # keys past the end: no bias entry
            if DB_HB:  # summed over the heads of this key/value head, stored after the last
                dbt = tl.where(g == 0, ds, dbt + ds)
                if g == G - 1:
                    _store_dbias(dbt, DB, b, hkv, i_r, j, qb, kb, rv, cv, sdb_b, sdb_h,
                                 sdb_m, sdb_n, DB_Q, DB_K)
            else:
                _store_dbias(ds, DB, b, h, i_r, j, qb, kb, rv, cv, sdb_b, sdb_h, sdb_m,
                             sdb_n, DB_Q, DB_K)
        if SOFTCAP:
            ds = ds * (1.0 - th * th)
        dk += _dot(ds.to(qt.dtype), tl.trans(qt), UPCAST, PREC)
    ooff = (b.to(tl.int64) * Hkv + hkv) * Lk + j
    tl.store(DK + ooff[:, None] * DQK + d[None, :], dk * dscale,
             mask=cv[:, None] & (d[None, :] < DQK))
    tl.store(DV_ + ooff[:, None] * DV + dv[None, :], dvacc,
             mask=cv[:, None] & (dv[None, :] < DV))


#: Do these kernels run under Triton's interpreter? Only when TRITON_INTERPRET=1 was set before
#: triton itself was imported: triton's own jit functions (``tl.zeros``, ``tl.sum`` ...) are
#: then interpreted too, and interpreted kernels calling compiled ones fail.
INTERPRET = (type(_attn_fwd).__name__ == "InterpretedFunction"
             and type(tl.zeros).__name__ != "JITFunction")


# ---- launchers (one per kernel) ---------------------------------------------------------------

Grid = Tuple[int, int, int]
Args = Sequence[Any]
Flags = Dict[str, Any]


def attn_fwd(grid: Grid, args: Args, flags: Flags, cfg: Dict[str, int]) -> None:
    """Launch ``_attn_fwd`` over ``grid`` with its positional ``args`` (in signature order),
    its constexpr ``flags`` and the launch ``cfg`` (num_warps, num_stages)."""
    _attn_fwd[grid](*args, **flags, **cfg)


def attn_merge(grid: Grid, args: Args, flags: Flags, cfg: Dict[str, int]) -> None:
    """Launch ``_attn_merge`` (combine the key splits of the forward)."""
    _attn_merge[grid](*args, **flags, **cfg)


def attn_bwd_dq(grid: Grid, args: Args, flags: Flags, cfg: Dict[str, int]) -> None:
    """Launch ``_attn_bwd_dq`` (dQ)."""
    _attn_bwd_dq[grid](*args, **flags, **cfg)


def attn_bwd_dkdv(grid: Grid, args: Args, flags: Flags, cfg: Dict[str, int]) -> None:
    """Launch ``_attn_bwd_dkdv`` (dK, dV and the bias gradient)."""
    _attn_bwd_dkdv[grid](*args, **flags, **cfg)


def dummy(device: torch.device) -> torch.Tensor:
    """A one-element tensor to pass for pointer arguments a launch does not use."""
    return torch.zeros(1, dtype=torch.int32, device=device)
