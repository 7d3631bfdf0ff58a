"""AttentionSpec: the validated, normalised, frozen description of one attention call.

Every front door (``attention``, ``flex_attention``, ``scaled_dot_product_attention``, varlen,
paged, ring) turns its arguments into :class:`Options`, and :func:`build_spec` turns those
into an :class:`AttentionSpec`; executors read nothing else. Shapes are canonical here:

    q (N, Hq, Lq, Dqk)   k (N, Hkv, Lk, Dqk)   v (N, Hkv, Lk, Dv)

where N is the product of the broadcast leading batch dims. Mask and bias tensors are kept
4-D with each dim either 1 (broadcast) or full size, so nothing of size Lq x Lk is created
that the user did not pass.

The score pipeline, in this order, for query i and key j (i' = i + diagonal offset):

    s = scale * q_i . k_j
    s = softcap * tanh(s / softcap)          (softcap)
    s = s + bias[i, j]                       (bias)
    s = s - slope[h] * |i' - j|              (alibi_slopes)
    s = score_mod(s, b, h, i, j)             (score_mod)
    s = -inf where the pair is not visible   (mask, mask_mod, BlockMask, causal, window, seqlens,
                                              starts_kv)

fp8 inputs (float8_e4m3fn / e5m2 q, k, v with ``descale_q/k/v``) are dequantized here, per
(batch, head), into the compute dtype (:func:`attnkit.fp8.dequantize_inputs`), so every term
below and every executor applies to them unchanged; ``p_scale`` (fp8 softmax weights) is a
feature, and ``out_dtype``/``out_scale`` are applied by the front door to the result.

:meth:`AttentionSpec.features` names every term, option and requested output a call uses;
each executor declares the features it supports (:mod:`attnkit.backends`), so a feature added
here is refused by every executor until one says it runs it.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch
from torch import Tensor

from .checks import (
    causal_bias_as_causal,
    causal_bias_class,
    check_alibi,
    check_device,
    check_float_tensor,
    check_plain_tensor,
    check_scale,
    check_seqlens,
    check_softcap,
    check_window,
    clamp_bound,
    compute_dtype_of,
)
from .fp8 import check_out_dtype, check_positive, dequantize_inputs
from .mods import check_score_mod_gradients, find_captured_tensors, info_of

Diagonal = Literal["top_left", "bottom_right"]
Window = Tuple[Optional[int], Optional[int]]

#: Every feature :meth:`AttentionSpec.features` can report.
FEATURES = frozenset({
    "window",              # causal / sliding-window bounds (spec.left, spec.right)
    "mask",                # a bool mask tensor
    "block_mask",          # a BlockMask
    "mask_mod",            # a mask_mod the spec could not turn into analytic terms
    "seqlens_q",           # right padding of the queries
    "seqlens_kv",          # right padding of the keys
    "starts_kv",           # left padding of the keys (per-row key start offsets)
    "segments",            # documents / packed sequences: visible within one segment
    "batch_segments",      # ... with segment ids per batch row (2-D document ids)
    "row_offset",          # a per-query-row diagonal shift (varlen's per-sequence alignment)
    "bias",                # an additive bias tensor
    "bias_grad",           # ... that requires grad (the backward needs dS)
    "alibi",               # ALiBi slopes per (batch, head)
    "alibi_rows",          # ALiBi slopes per query row (varlen: per sequence)
    "softcap",             # cap * tanh(s / cap)
    "score_mod",           # an arbitrary score_mod
    "additive_score_mod",  # a builtin additive score_mod (its bias is known)
    "score_mod_grad",      # tensors a score_mod reads require grad
    "sinks",               # one extra logit per head
    "dropout",             # Philox dropout
    "dropout_mask",        # a given keep mask
    "max_scores",          # the row maxima are requested
    "paged_kv",            # keys and values are read from pages through a block table
    "fp8_kv",              # ... the pages are fp8, with per-(page, kv head) descales
    "p_scale",             # the softmax weights are quantized to fp8 before P V (cuDNN scale_s)
})


@dataclass(frozen=True)
class Options:
    """Every option of an attention call: the keywords of :func:`attnkit.attention` (see its
    docstring for the meaning of each). Front doors take them as keywords and say in one
    place which they do not support (:meth:`from_kwargs`)."""

    scale: Optional[float] = None
    mask: Any = None
    bias: Optional[Tensor] = None
    causal: bool = False
    window: Optional[Window] = None
    diagonal: str = "top_left"
    score_mod: Optional[Callable[..., Tensor]] = None
    softcap: Optional[float] = None
    alibi_slopes: Any = None
    seqlens_q: Any = None
    seqlens_kv: Any = None
    starts_kv: Any = None
    sinks: Optional[Tensor] = None
    dropout_p: float = 0.0
    seed: Optional[int] = None
    offset: int = 0
    dropout_mask: Optional[Tensor] = None
    descale_q: Any = None
    descale_k: Any = None
    descale_v: Any = None
    p_scale: Optional[float] = None
    out_dtype: Optional[torch.dtype] = None
    out_scale: Optional[float] = None

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        return _OPTION_NAMES

    @classmethod
    def from_kwargs(cls, door: str, kwargs: Mapping[str, Any],
                    takes: Optional[DoorOptions] = None) -> Options:
        """The options ``door`` was called with. An unknown keyword is a ``TypeError`` that
        lists the valid ones; an option the door does not take (``takes``, its
        :class:`DoorOptions`; None: every option) given a value other than its default is a
        ``NotImplementedError`` that says why."""
        names = cls.names()
        refused = takes.refused if takes is not None else frozenset()
        for key in kwargs:
            if key not in names:
                valid = ", ".join(n for n in names if n not in refused)
                raise TypeError(f"{door}() got an unexpected keyword argument {key!r}; its "
                                f"options are: {valid}")
        defaults = _DEFAULT_OPTIONS
        for key in refused & kwargs.keys():
            if not _is_default(kwargs[key], getattr(defaults, key)):
                raise NotImplementedError(f"{door}() does not take {key}: "
                                          f"{takes.reason(key)}")  # type: ignore[union-attr]
        return cls(**kwargs)

    def merged(self, **changes: Any) -> Options:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


_OPTION_NAMES = tuple(f.name for f in fields(Options))  # (torch.compile traces a constant)
_DEFAULT_OPTIONS = Options()


@dataclass(frozen=True)
class DoorOptions:
    """Which :class:`Options` a front door takes, as data (as the executors declare their
    :class:`~attnkit.backends.base.Capabilities`): ``takes`` is an allow-list of option names
    and ``why`` gives the reason for refusing some of the others; every option not taken is
    refused (:meth:`Options.from_kwargs` raises ``NotImplementedError`` with the reason), so
    an option added to :class:`Options` is refused by a door until the door carries it."""

    door: str
    takes: FrozenSet[str]
    why: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = (self.takes | set(self.why)) - set(_OPTION_NAMES)
        if unknown or self.takes & set(self.why):
            raise ValueError(f"{self.door}: DoorOptions names options that do not exist "
                             f"({sorted(unknown)}) or both takes and refuses "
                             f"{sorted(self.takes & set(self.why))}")

    @classmethod
    def all_but(cls, door: str, why: Mapping[str, str]) -> DoorOptions:
        """A door that passes its :class:`Options` whole to :func:`build_spec` (so it carries
        every option by construction) but those in ``why``."""
        return cls(door, frozenset(_OPTION_NAMES) - set(why), dict(why))

    @property
    def refused(self) -> FrozenSet[str]:
        return frozenset(_OPTION_NAMES) - self.takes

    def reason(self, name: str) -> str:
        """Why the door refuses option ``name``."""
        return self.why.get(name, f"{self.door} does not carry {name} (yet); call "
                                  f"attnkit.attention for it")


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (not isinstance(value, Tensor) and value == default)


@dataclass(frozen=True)
class PagedKV:
    """Keys and values read in place from pages (FlashAttention / vLLM layout):
    ``k_pages (P, page, Hkv, Dqk)``, ``v_pages (P, page, Hkv, Dv)``, ``block_table (N, W)``
    int64 (row b lists sequence b's pages); the lengths are the spec's ``seqlens_kv``. fp8
    pages come with their descales."""

    k_pages: Tensor
    v_pages: Tensor
    block_table: Tensor
    #: fp8 pages: the real values are ``pages * descale[page, head]``, ``(P, Hkv)`` float32
    k_descale: Optional[Tensor] = None
    v_descale: Optional[Tensor] = None

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]


@dataclass(frozen=True)
class AttentionSpec:
    """One attention call, validated and in canonical shapes (see the module docstring).
    Built by :func:`build_spec` only; frozen."""

    q: Tensor
    k: Tensor
    v: Tensor
    batch_shape: Tuple[int, ...]
    squeeze_heads: bool
    scale: float
    mask: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    mask_mod: Optional[Callable[..., Tensor]] = None
    block_mask: Any = None
    score_mod: Optional[Callable[..., Tensor]] = None
    score_mod_params: Tuple[Tensor, ...] = ()
    softcap: Optional[float] = None
    alibi_slopes: Optional[Tensor] = None
    left: Optional[int] = None
    right: Optional[int] = None
    diagonal: Diagonal = "top_left"
    seqlens_q: Optional[Tensor] = None
    seqlens_kv: Optional[Tensor] = None
    #: per-row key start offsets (N,): keys before starts_kv[b] are invisible (left padding)
    starts_kv: Optional[Tensor] = None
    sinks: Optional[Tensor] = None
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    dropout_mask: Optional[Tensor] = None
    #: per-query-row shift of the diagonal (varlen: each row's own sequence alignment), (Lq,)
    row_offset: Optional[Tensor] = None
    #: segment ids (Lq,), (Lk,), or per batch row (N, Lq), (N, Lk): a pair is visible only
    #: within one segment (varlen, documents)
    segments_q: Optional[Tensor] = None
    segments_kv: Optional[Tensor] = None
    #: K/V read from pages (``k``/``v`` are then zero-stride stand-ins of the right shape)
    paged: Optional[PagedKV] = None
    #: requested outputs beyond out and lse ("max_scores")
    outputs: FrozenSet[str] = field(default_factory=frozenset)
    #: quantize the softmax weights to fp8 with this scale before P V (then descale)
    p_scale: Optional[float] = None
    #: the dtype the front door returns ``out`` in (None: q's), and the fp8 output's scale
    out_dtype: Optional[torch.dtype] = None
    out_scale: Optional[float] = None

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def hq(self) -> int:
        return self.q.shape[1]

    @property
    def hkv(self) -> int:
        return self.k.shape[1]

    @property
    def groups(self) -> int:
        return self.hq // self.hkv if self.hkv else 1

    @property
    def is_empty(self) -> bool:
        """No output element to compute (no batch rows, heads or query rows)."""
        return self.n == 0 or self.hq == 0 or self.lq == 0

    @property
    def lq(self) -> int:
        return self.q.shape[2]

    @property
    def lk(self) -> int:
        return self.k.shape[2]

    @property
    def dqk(self) -> int:
        return self.q.shape[3]

    @property
    def dv(self) -> int:
        return self.v.shape[3]

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype_of(self.q.dtype)

    @property
    def has_band(self) -> bool:
        return self.left is not None or self.right is not None

    def features(self) -> FrozenSet[str]:
        """Every mask term, score term, option and requested output this call uses (names
        from :data:`FEATURES`; worked out once per spec: every executor's check reads it)."""
        cached = self.__dict__.get("_features")
        if cached is not None:
            return cached
        f = set(self.outputs)
        info = info_of(self.score_mod)
        for name, on in (
                ("window", self.has_band), ("mask", self.mask is not None),
                ("block_mask", self.block_mask is not None),
                ("mask_mod", self.mask_mod is not None),
                ("seqlens_q", self.seqlens_q is not None),
                ("seqlens_kv", self.seqlens_kv is not None),
                ("starts_kv", self.starts_kv is not None),
                ("segments", self.segments_q is not None and self.segments_q.dim() == 1),
                ("batch_segments", self.segments_q is not None and self.segments_q.dim() == 2),
                ("row_offset", self.row_offset is not None),
                ("bias", self.bias is not None),
                ("bias_grad", self.bias is not None and self.bias.requires_grad),
                ("alibi", self.alibi_slopes is not None and self.alibi_slopes.dim() == 2),
                ("alibi_rows", self.alibi_slopes is not None and self.alibi_slopes.dim() == 3),
                ("softcap", self.softcap is not None),
                ("score_mod", self.score_mod is not None and (info is None or info.bias is None)),
                ("additive_score_mod", info is not None and info.bias is not None),
                ("score_mod_grad", bool(self.score_mod_params)),
                ("sinks", self.sinks is not None),
                ("dropout", self.dropout_mask is None and self.dropout_p > 0.0),
                ("dropout_mask", self.dropout_mask is not None),
                ("paged_kv", self.paged is not None),
                ("p_scale", self.p_scale is not None),
                ("fp8_kv", self.paged is not None and self.paged.k_descale is not None)):
            if on:
                f.add(name)
        self.__dict__["_features"] = frozen = frozenset(f)  # (not a field: eq and replace skip it)
        return frozen

    def diag_offset(self) -> Union[int, Tensor]:
        """i' - i: 0 for top-left, Lk - Lq (per batch row with seqlens) for bottom-right."""
        if self.diagonal == "top_left":
            return 0
        if self.seqlens_q is not None or self.seqlens_kv is not None:
            sq = self.seqlens_q if self.seqlens_q is not None else torch.full(
                (self.n,), self.lq, dtype=torch.int64, device=self.q.device)
            sk = self.seqlens_kv if self.seqlens_kv is not None else torch.full(
                (self.n,), self.lk, dtype=torch.int64, device=self.q.device)
            return (sk - sq).view(-1, 1, 1, 1)
        return self.lk - self.lq

    def aligned_rows(self, q0: int = 0, q1: Optional[int] = None) -> Tensor:
        """i' (the aligned query position) of rows [q0, q1), shape (N|1, 1, rows, 1)."""
        q1 = self.lq if q1 is None else q1
        ip = torch.arange(q0, q1, device=self.q.device).view(1, 1, -1, 1) + self.diag_offset()
        if self.row_offset is not None:
            ip = ip + self.row_offset[q0:q1].view(1, 1, -1, 1)
        return ip

    def alibi_rows(self, q0: int = 0, q1: Optional[int] = None) -> Tensor:
        """ALiBi slopes for query rows [q0, q1): ``(N|1, Hq, rows|1, 1)``."""
        s = self.alibi_slopes
        if s.dim() == 2:
            return s.view(s.shape[0], self.hq, 1, 1)
        q1 = self.lq if q1 is None else q1
        return s[:, :, q0:q1].unsqueeze(-1)

    def slice_batch(self, b: int, len_q: int, len_kv: int, q_start: int = 0,
                    kv_start: int = 0) -> AttentionSpec:
        """Batch row ``b`` cut to queries ``[q_start, len_q)`` and keys ``[kv_start, len_kv)``,
        as a call of its own: ``len_q`` and ``len_kv`` are the row's real lengths (padding
        becomes plain shape; a bottom-right diagonal aligns to them). Mods keep seeing batch
        index ``b`` and the original positions, and a top-left diagonal stays where it was
        (cut at different query and key starts, the rows get the shift as a row offset)."""
        from .mods import remap

        q0, k0 = q_start, kv_start

        def cut(x: Optional[Tensor]) -> Optional[Tensor]:
            if x is None:
                return None
            x = x[b:b + 1] if x.shape[0] > 1 else x
            x = x[:, :, q0:len_q] if x.shape[2] > 1 else x
            return x[:, :, :, k0:len_kv] if x.shape[3] > 1 else x

        def shift(mod: Optional[Callable], score: bool) -> Optional[Callable]:
            if mod is None or (b == 0 and q0 == 0 and k0 == 0):
                return mod
            suffix = f"b{b}" + (f"q{q0}k{k0}" if q0 or k0 else "")
            # a score_mod's structure (relative: j - i) survives a shift of both by as much
            return remap(mod, lambda bb, h, i, j: (bb + b, h, i + q0, j + k0), score=score,
                         suffix=suffix, keep_structure=score and q0 == k0)

        slopes = self.alibi_slopes
        if slopes is not None:
            slopes = slopes[b:b + 1] if slopes.shape[0] > 1 else slopes
            slopes = slopes[:, :, q0:len_q] if slopes.dim() == 3 else slopes
        # the cut ends where the row's real queries and keys end (a bottom-right diagonal
        # stays aligned to them); its starts move a top-left diagonal by q_start - kv_start
        extra = q0 - k0 if self.diagonal == "top_left" else 0
        row_offset = self.row_offset
        if row_offset is not None:
            row_offset = row_offset[q0:len_q] + extra
        elif extra and (self.has_band or slopes is not None):
            row_offset = torch.full((len_q - q0,), extra, dtype=torch.int64,
                                    device=self.q.device)
        seg_q, seg_kv = self.segments_q, self.segments_kv
        if seg_q is not None:  # (per-row ids become the row's own)
            seg_q = (seg_q[b] if seg_q.dim() == 2 else seg_q)[q0:len_q]
            seg_kv = (seg_kv[b] if seg_kv.dim() == 2 else seg_kv)[k0:len_kv]
        return replace(self, q=self.q[b:b + 1, :, q0:len_q], k=self.k[b:b + 1, :, k0:len_kv],
                       v=self.v[b:b + 1, :, k0:len_kv], batch_shape=(1,), mask=cut(self.mask),
                       bias=cut(self.bias), alibi_slopes=slopes, seqlens_q=None,
                       seqlens_kv=None, starts_kv=None, row_offset=row_offset,
                       mask_mod=shift(self.mask_mod, False),
                       score_mod=shift(self.score_mod, True), sinks=None,
                       segments_q=seg_q, segments_kv=seg_kv)

    def output_shape(self, last: int) -> Tuple[int, ...]:
        if self.squeeze_heads:
            return (self.lq, last)
        return (*self.batch_shape, self.hq, self.lq, last)

    def lse_shape(self) -> Tuple[int, ...]:
        if self.squeeze_heads:
            return (self.lq,)
        return (*self.batch_shape, self.hq, self.lq)


_SPEC_DEFAULTS = {f.name: f.default for f in fields(AttentionSpec)
                  if f.default is not MISSING}


def _new_spec(values: Dict[str, Any]) -> AttentionSpec:
    """``AttentionSpec(**values)`` in one step: the frozen dataclass's ``__init__`` sets its
    thirty fields one by one through ``object.__setattr__``, which is a tenth of a decoding
    step's budget (one spec per layer per token). Same object, same fields, same defaults."""
    spec = object.__new__(AttentionSpec)
    d = spec.__dict__
    d.update(_SPEC_DEFAULTS)
    d["outputs"] = frozenset()
    d.update(values)
    return spec


# ---- canonical shapes ----------------------------------------------------------------------


def _broadcast_batch(shapes: Sequence[Tuple[str, Tuple[int, ...]]]) -> Tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*[s for _, s in shapes]))
    except RuntimeError:
        desc = ", ".join(f"{n} {tuple(s)}" for n, s in shapes)
        raise ValueError(
            f"the leading batch dims do not broadcast: {desc}; make them equal or 1") from None


def _canonical_qkv(q: Tensor, k: Tensor, v: Tensor):
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, x)
    if q.device.type == "meta":
        raise ValueError("q is on the meta device (shapes without data); attnkit computes on "
                         "real tensors: create q, k and v on the CPU (or a GPU)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}: "
            f"convert them to one dtype first")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device; got q {q.device}, k {k.device}, v {v.device}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head dim (last dim); got q {q.shape[-1]} and "
            f"k {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same length (dim -2); got k {k.shape[-2]} and "
            f"v {v.shape[-2]}")
    dims = {q.dim(), k.dim(), v.dim()}
    squeeze = dims == {2}
    if 2 in dims and not squeeze:
        raise ValueError(
            f"q, k and v must all be 2-D (L, D) or all have a head dim (..., H, L, D); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if squeeze:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    hq, hkv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != hkv:
        raise ValueError(
            f"k and v must have the same number of heads; got k {hkv} and v {v.shape[-3]}")
    if hkv == 0 and hq > 0:
        raise ValueError(f"k has 0 heads but q has {hq}; every query head needs a key/value "
                         f"head (grouped-query attention: Hq a multiple of Hkv)")
    if hkv and hq % hkv != 0:
        hint = ""
        if q.dim() >= 3 and q.shape[-2] % hkv == 0 and q.shape[-2] != k.shape[-2]:
            hint = (f"; q looks token-major ({tuple(q.shape)} read as (..., L, heads, d)): "
                    f"attnkit takes (batch, heads, L, d), so pass q.transpose(-3, -2)")
        raise ValueError(
            f"q has {hq} heads and k has {hkv}; the number of query heads must be a multiple "
            f"of the number of key/value heads (grouped-query attention){hint}")
    if q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0]:
        return q, k, v, (q.shape[0],), squeeze  # already canonical (the common case)
    batch = _broadcast_batch([("q", q.shape[:-3]), ("k", k.shape[:-3]), ("v", v.shape[:-3])])
    n = math.prod(batch)

    def canon(x: Tensor) -> Tensor:
        x = x.expand(*batch, *x.shape[-3:])
        return x.reshape(n, *x.shape[-3:])

    return canon(q), canon(k), canon(v), batch, squeeze


def _canonical_4d(name: str, x: Tensor, batch: Tuple[int, ...], n: int,
                  full: Tuple[int, int, int]) -> Tensor:
    """Reshape a mask/bias broadcastable to (*batch, H, Lq, Lk) into 4-D (n|1, H|1, Lq|1, Lk|1)."""
    target = (*batch, *full)
    if x.dim() > len(target):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, which does not broadcast to the scores "
            f"{target} (batch, heads, Lq, Lk)")
    shape = (1,) * (len(target) - x.dim()) + tuple(x.shape)
    for got, want in zip(shape, target):
        if got not in (1, want):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, which does not broadcast to the scores "
                f"{target} (batch, heads, Lq, Lk); each dim must be 1 or equal")
    wants_grad = x.requires_grad
    x = x.reshape(shape)
    bshape = shape[: len(batch)]
    if all(s == 1 for s in bshape):
        x = x.reshape(1, *shape[len(batch):])
    else:
        x = x.expand(*batch, *shape[len(batch):]).reshape(n, *shape[len(batch):])
    if wants_grad and not x.requires_grad:
        # views recorded no autograd (inside a custom op, below autograd): the executors read
        # requires_grad to know which gradients to compute, and compute them explicitly
        x = x.detach().requires_grad_(True)
    return x


def band(causal: bool, window: Any) -> Tuple[Optional[int], Optional[int]]:
    """The key bounds ``(left, right)`` of ``causal`` and ``window`` (validated) before they
    are clamped to a grid: ``causal`` caps ``right`` at 0. :func:`build_spec` clamps them
    to ``+-(Lq + Lk + 1)``, which changes no result; a decoding replay keeps them as they are,
    for every cache length."""
    left, right = check_window(window)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def build_spec(q: Tensor, k: Tensor, v: Tensor, options: Optional[Options] = None, *,
               segments: Optional[Tuple[Tensor, Tensor]] = None,
               row_offset: Optional[Tensor] = None, paged: Optional[PagedKV] = None,
               outputs: FrozenSet[str] = frozenset(), **kwargs: Any) -> AttentionSpec:
    """Validate one call's inputs and :class:`Options` (or the same as keywords) and normalise
    them into an :class:`AttentionSpec`.

    The keyword-only arguments are the front doors' own: ``segments`` (segment ids of the
    queries and keys) and ``row_offset`` (per-row diagonal shift) from varlen, ``paged`` from
    the paged front door, ``outputs`` the requested extra outputs."""
    opts = options if options is not None else Options.from_kwargs("build_spec", kwargs)
    causal, diagonal, mask, bias = opts.causal, opts.diagonal, opts.mask, opts.bias
    cb = causal_bias_class() if mask is not None or bias is not None else None
    for name in ("mask", "bias"):
        x = mask if name == "mask" else bias
        if cb is not None and isinstance(x, cb):  # torch's CausalBias: causal with a diagonal
            causal, diagonal = causal_bias_as_causal(name, x, causal, diagonal, q.shape[-2],
                                                     k.shape[-2])
            mask, bias = (None, bias) if name == "mask" else (mask, None)
    for name, x in (("q", q), ("k", k), ("v", v), ("mask", mask), ("bias", bias),
                    ("sinks", opts.sinks), ("dropout_mask", opts.dropout_mask)):
        check_plain_tensor(name, x)
    out_dtype, out_scale = check_out_dtype(opts.out_dtype, opts.out_scale)
    q, k, v = dequantize_inputs(q, k, v, opts.descale_q, opts.descale_k, opts.descale_v,
                                out_dtype)
    qc, kc, vc, batch, squeeze = _canonical_qkv(q, k, v)
    n, hq, lq, d = qc.shape
    lk = kc.shape[2]
    full = (hq, lq, lk)
    dev = qc.device
    f: dict = {"q": qc, "k": kc, "v": vc, "batch_shape": batch, "squeeze_heads": squeeze,
               "scale": check_scale(opts.scale, d), "outputs": frozenset(outputs),
               "paged": paged, "p_scale": check_positive("p_scale", opts.p_scale),
               "out_dtype": out_dtype, "out_scale": out_scale}

    if diagonal not in ("top_left", "bottom_right"):
        raise ValueError(f"diagonal must be 'top_left' or 'bottom_right'; got {diagonal!r}")
    f["diagonal"] = diagonal
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    left, right = band(causal, opts.window)
    f["left"], f["right"] = clamp_bound(left, lq, lk), clamp_bound(right, lq, lk)
    for name, x in (("mask", mask), ("bias", bias), ("sinks", opts.sinks),
                    ("dropout_mask", opts.dropout_mask)):
        check_device(name, x, dev)

    if mask is not None:
        if isinstance(mask, Tensor):
            if mask.dtype != torch.bool:
                raise TypeError(
                    f"mask must be a bool tensor (True = may attend); got dtype {mask.dtype}. "
                    f"For an additive float mask pass it as bias=")
            f["mask"] = _canonical_4d("mask", mask, batch, n, full)
        elif _is_block_mask(mask):
            f["block_mask"] = _block_mask(mask, n, hq, lq, lk)
        elif callable(mask):
            f["mask_mod"] = mask
        else:
            raise TypeError(
                f"mask must be a bool tensor, a mask_mod callable (b, h, q_idx, kv_idx) -> bool "
                f"or a BlockMask; got {type(mask).__name__}")

    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be a float tensor; got {type(bias).__name__}")
        if not bias.dtype.is_floating_point:
            raise TypeError(
                f"bias must be a float tensor added to the scores; got dtype {bias.dtype}. "
                f"For a bool mask pass it as mask=")
        f["bias"] = _canonical_4d("bias", bias, batch, n, full)

    if opts.score_mod is not None:
        if not callable(opts.score_mod):
            raise TypeError(f"score_mod must be a callable (score, b, h, q_idx, kv_idx) -> "
                            f"score; got {type(opts.score_mod).__name__}")
        f["score_mod"] = opts.score_mod
        f["score_mod_params"] = tuple(find_captured_tensors(opts.score_mod))
        if torch.is_grad_enabled():
            check_score_mod_gradients(opts.score_mod, f["score_mod_params"], qc)

    compute = compute_dtype_of(qc.dtype)
    if opts.softcap is not None:
        f["softcap"] = check_softcap(opts.softcap, compute)
    if opts.alibi_slopes is not None:
        f["alibi_slopes"] = check_alibi(opts.alibi_slopes, n, hq, lq, dev, compute)
    f["seqlens_q"], f["seqlens_kv"], f["starts_kv"] = normal_padding(
        opts.seqlens_q, opts.seqlens_kv, opts.starts_kv, n, lq, lk, dev)
    if opts.sinks is not None:
        sinks = opts.sinks
        if not isinstance(sinks, Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks must be a float tensor of shape ({hq},)")
        if sinks.shape != (hq,):
            raise ValueError(f"sinks must have shape ({hq},) (one logit per query head); got "
                             f"{tuple(sinks.shape)}")
        f["sinks"] = sinks
    f.update(_dropout(opts, batch, n, full))
    if segments is not None:
        f["segments_q"], f["segments_kv"] = segments
    f["row_offset"] = row_offset
    spec = _new_spec(f)
    if spec.mask_mod is not None:
        spec = absorb_mask_structure(spec)  # last: it needs the final diagonal offsets
    return spec


def normal_padding(seqlens_q: Any, seqlens_kv: Any, starts_kv: Any, n: int, lq: int, lk: int,
                   device: torch.device
                   ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The padding options as a spec holds them: int64 ``(N,)`` tensors checked against the
    lengths, None where absent, and None for starts that hide no key. :func:`build_spec` and
    the replay of recurring calls (:func:`attnkit.api.attention`) both call this, so what a
    replayed call's padding normalises to is what the full path's would."""
    return (None if seqlens_q is None else check_seqlens("seqlens_q", seqlens_q, n, lq, device),
            None if seqlens_kv is None else check_seqlens("seqlens_kv", seqlens_kv, n, lk,
                                                           device),
            None if starts_kv is None else _check_starts(starts_kv, n, lk, device))


def signature(spec: AttentionSpec) -> Tuple[Any, ...]:
    """The normalised form of a call, without its tensors' contents or its number of keys:
    every feature, dtype, shape but Lk, and scalar that :func:`build_spec` decided, and which
    window bounds exist (their values are clamped to Lk). Two calls with one signature are
    one form for every executor's choice and every prepared launcher; the replay of recurring
    calls checks it (:data:`attnkit.api.CHECK_REPLAYS`)."""
    return (spec.features(), spec.q.dtype, spec.k.dtype, spec.v.dtype, spec.q.device,
            tuple(spec.q.shape), spec.hkv, spec.dv, spec.batch_shape, spec.squeeze_heads,
            spec.scale, spec.softcap, spec.diagonal, spec.left is None, spec.right is None,
            spec.dropout_p, spec.p_scale, spec.out_dtype, spec.out_scale)


def _check_starts(x: Any, n: int, lk: int, device: torch.device) -> Optional[Tensor]:
    """``starts_kv`` as int64 ``(N,)``, each in ``[0, Lk]``; None when every start is 0 (no
    key is hidden)."""
    want = f"an integer tensor of shape ({n},) (one key start offset per batch row)"
    if not isinstance(x, Tensor):
        try:
            x = torch.as_tensor(x, device=device)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"starts_kv must be {want} or a list of ints; got "
                            f"{type(x).__name__}") from err
    check_device("starts_kv", x, device)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"starts_kv must be {want}; got dtype {x.dtype}: convert it with "
                        f".long()")
    if x.shape != (n,):
        raise ValueError(f"starts_kv must be {want}: keys before starts_kv[b] are hidden from "
                         f"batch row b; got shape {tuple(x.shape)}")
    if n == 0:
        return None
    x = x.to(device=device, dtype=torch.int64)
    lo, hi = int(x.min()), int(x.max())
    if lo < 0 or hi > lk:
        raise ValueError(f"starts_kv must lie in [0, {lk}] (the keys' length Lk = {lk}); got "
                         f"min {lo}, max {hi}")
    return x if hi > 0 else None


def _dropout(opts: Options, batch: Tuple[int, ...], n: int,
             full: Tuple[int, int, int]) -> dict:
    p, keep = opts.dropout_p, opts.dropout_mask
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1]; got {p!r}")
    p = float(p)
    if not (0.0 <= p <= 1.0):  # also rejects NaN; 1 drops every weight (torch: zeros)
        raise ValueError(f"dropout_p must be in [0, 1]; got {p}")
    if keep is not None:
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
            raise TypeError("dropout_mask must be a bool tensor (True = keep) broadcastable to "
                            "the scores")
        return {"dropout_p": p, "dropout_mask": _canonical_4d("dropout_mask", keep, batch, n,
                                                              full)}
    if p == 0.0:
        return {"dropout_p": p}
    from .dropout import _check_offset, _check_seed, draw_seed

    return {"dropout_p": p, "seed": _check_seed(draw_seed() if opts.seed is None else opts.seed),
            "offset": _check_offset(opts.offset)}


def _is_block_mask(x: Any) -> bool:
    return hasattr(x, "kv_num_blocks") and hasattr(x, "BLOCK_SIZE") and hasattr(x, "mask_mod")


def _block_mask(bm: Any, n: int, hq: int, lq: int, lk: int) -> Any:
    """attnkit's BlockMask for ``bm`` (torch's is converted), checked against the inputs."""
    from .block_mask import BlockMask

    if not isinstance(bm, BlockMask):
        bm = BlockMask.from_torch(bm)
    seq = tuple(bm.seq_lengths)
    if seq != (lq, lk):
        raise ValueError(f"the BlockMask was built for (Q_LEN, KV_LEN) = {seq} but the inputs "
                         f"have ({lq}, {lk}); rebuild it with create_block_mask")
    bb, bh = bm.kv_num_blocks.shape[:2]
    if bb not in (1, n) or bh not in (1, hq):
        raise ValueError(f"the BlockMask has batch {bb} and heads {bh}; expected 1 or {n} and "
                         f"1 or {hq}")
    return bm


# ---- builtin mask structure as analytic terms ----------------------------------------------


def absorb_mask_structure(spec: AttentionSpec) -> AttentionSpec:
    """Turn a builtin mask_mod's structure (causal/window bands, documents with ids shared by
    the batch or per batch row, and ANDs of them) into analytic spec terms, so the planner
    skips and classifies tiles without evaluating the mask. When every part converts, the
    mask_mod is dropped; otherwise it stays (and is evaluated only on tiles the analytic terms
    leave alive)."""
    from .masks import structure_of

    st = structure_of(spec.mask_mod)
    if st is None:
        return spec
    _check_document_sizes(st, spec.lq, spec.lk)
    parts = st["parts"] if st.get("kind") == "and" else [st]
    done = True
    for part in parts:
        absorbed = _absorb_part(spec, part)
        if absorbed is None:
            done = False
        else:
            spec = absorbed
    return replace(spec, mask_mod=None) if done else spec


def _check_document_sizes(st: Optional[dict], lq: int, lk: int) -> None:
    """A builtin document mask (anywhere in an and/or/not) must cover every position."""
    if st is None:
        return
    for part in st.get("parts", ()):
        _check_document_sizes(part, lq, lk)
    _check_document_sizes(st.get("part"), lq, lk)
    if st.get("kind") != "document":
        return
    nq, nk = st["doc_ids_q"].shape[-1], st["doc_ids_kv"].shape[-1]
    if nq >= lq and nk >= lk:  # (longer ids: the mask reads the first Lq / Lk of them)
        return
    if "lengths" in st:
        lengths = st["lengths"].tolist()
        raise ValueError(f"the document lengths {lengths} sum to {sum(lengths)} but the "
                         f"sequence has {lq if nq < lq else lk} positions (Lq={lq}, Lk={lk}); "
                         f"give lengths that add up to the sequence length")
    raise ValueError(f"the document mask has ids for {nq} query and {nk} key positions but "
                     f"the inputs have Lq={lq} and Lk={lk}; give one document id per position")


def _absorb_part(spec: AttentionSpec, st: Optional[dict]) -> Optional[AttentionSpec]:
    """``spec`` with one structure part as analytic terms, or None when it cannot convert."""
    if st is None:
        return None
    kind = st.get("kind")
    if kind == "full":
        return spec
    if kind in ("causal", "window"):
        off = spec.diag_offset()
        if spec.has_band or not isinstance(off, int) or spec.row_offset is not None:
            return None
        lo, hi = st["band"]  # visible iff lo <= j - i <= hi
        return replace(spec, left=None if lo is None else clamp_bound(off - lo, spec.lq, spec.lk),
                       right=None if hi is None else clamp_bound(hi - off, spec.lq, spec.lk))
    if kind == "document":  # ids (L,) shared by the batch, or (N, L): one row per batch row
        ids_q, ids_kv = st["doc_ids_q"], st["doc_ids_kv"]
        rows = () if ids_q.dim() == 1 else (spec.n,)
        if (spec.segments_q is not None or tuple(ids_q.shape) != (*rows, spec.lq)
                or tuple(ids_kv.shape) != (*rows, spec.lk)):
            return None
        return replace(spec, segments_q=ids_q.to(spec.q.device, torch.int64),
                       segments_kv=ids_kv.to(spec.q.device, torch.int64))
    return None
