"""AttentionSpec: the validated, normalised description of one attention call.

Every front door (``attention``, ``flex_attention``, ``scaled_dot_product_attention``, varlen,
paged) builds one of these; executors read nothing else. Shapes are canonical here:

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
    s = -inf where the pair is not visible   (mask, mask_mod, BlockMask, causal, window, seqlens)
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

Diagonal = Literal["top_left", "bottom_right"]
Window = Tuple[Optional[int], Optional[int]]

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass
class AttentionSpec:
    """One attention call, validated and in canonical shapes (see the module docstring)."""

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
    sinks: Optional[Tensor] = None
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    dropout_mask: Optional[Tensor] = None
    #: per-query-row shift of the diagonal (varlen: each row's own sequence alignment), (Lq,)
    row_offset: Optional[Tensor] = None
    #: segment ids (Lq,), (Lk,): a pair is visible only within one segment (varlen, documents)
    segments_q: Optional[Tensor] = None
    segments_kv: Optional[Tensor] = None

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
    def dv(self) -> int:
        return self.v.shape[3]

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32

    @property
    def has_band(self) -> bool:
        return self.left is not None or self.right is not None

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

    def output_shape(self, last: int) -> Tuple[int, ...]:
        if self.squeeze_heads:
            return (self.lq, last)
        return (*self.batch_shape, self.hq, self.lq, last)

    def lse_shape(self) -> Tuple[int, ...]:
        if self.squeeze_heads:
            return (self.lq,)
        return (*self.batch_shape, self.hq, self.lq)


# ---- validation helpers --------------------------------------------------------------------


def tensor_argument(name: str, value: Any, dims: Tuple[int, ...], kind: str) -> Tensor:
    """A mask or score-mod argument (a tensor or a list) as a tensor with one of ``dims``
    dimensions: ``kind="int"`` gives int64 (from any integer dtype), ``kind="float"`` keeps a
    floating tensor as it is (a list becomes float32)."""
    integer = kind == "int"
    noun, what, fix = (("an integer", "ints", ".long()") if integer
                       else ("a float", "floats", ".float()"))
    if not isinstance(value, Tensor):
        try:
            value = torch.as_tensor(value, dtype=torch.int64 if integer else torch.float32)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{name} must be {noun} tensor or a list of {what}, got "
                            f"{type(value).__name__}.") from err
    wrong = (value.dtype.is_floating_point or value.dtype.is_complex
             or value.dtype == torch.bool) if integer else not value.dtype.is_floating_point
    if wrong:
        raise TypeError(f"{name} must have {'an integer' if integer else 'a floating'} dtype, "
                        f"got {value.dtype}; convert it with {fix}.")
    if value.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(value.shape)}.")
    return value.to(torch.int64) if integer else value


def _check_tensor(name: str, x: Any) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; attention needs a floating dtype "
            f"(float64, float32, bfloat16 or float16): convert with {name}.float()")
    if x.dim() < 2:
        raise ValueError(
            f"{name} must have at least 2 dims (L, D); got shape {tuple(x.shape)}")
    return x


def _broadcast_batch(shapes: Sequence[Tuple[str, Tuple[int, ...]]]) -> Tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*[s for _, s in shapes]))
    except RuntimeError:
        desc = ", ".join(f"{n} {tuple(s)}" for n, s in shapes)
        raise ValueError(
            f"the leading batch dims do not broadcast: {desc}; make them equal or 1") from None


def _canonical_qkv(q: Tensor, k: Tensor, v: Tensor):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
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
        raise ValueError(
            f"q has {hq} heads and k has {hkv}; the number of query heads must be a multiple "
            f"of the number of key/value heads (grouped-query attention)")
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
    x = x.reshape(shape)
    bshape = shape[: len(batch)]
    if all(s == 1 for s in bshape):
        return x.reshape(1, *shape[len(batch):])
    x = x.expand(*batch, *shape[len(batch):])
    return x.reshape(n, *shape[len(batch):])


def _check_scale(scale: Any, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d) if d else 1.0  # head dim 0: every score is 0 anyway
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a number; got a tensor of shape {tuple(scale.shape)}")
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float; got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale}. Leave it None for "
                         f"1/sqrt(head_dim)")
    return scale


def _clamp_bound(w: Optional[int], lq: int, lk: int) -> Optional[int]:
    """A window bound (any int, None = unbounded) clamped to +-(Lq + Lk + 1): every bound
    beyond that has the same meaning, and the planner's integer arithmetic stays small."""
    if w is None:
        return None
    limit = lq + lk + 1
    return max(-limit, min(limit, w))


def _check_device(name: str, x: Any, device: torch.device) -> None:
    if isinstance(x, Tensor) and x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; move it with "
                         f"{name}.to(q.device)")


#: Softcaps float32 computes reliably (the tiled executor divides the query scale by the cap).
SOFTCAP_RANGE = (2.0 ** -60, 2.0 ** 60)


def _check_softcap(softcap: Any, compute: torch.dtype) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float > 0 or None; got {softcap!r}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be finite and > 0 (None turns it off); got {softcap}")
    lo, hi = SOFTCAP_RANGE
    if compute != torch.float64 and not lo <= softcap <= hi:
        raise ValueError(f"softcap={softcap:g} is outside what float32 (the compute dtype of "
                         f"these inputs) computes reliably, [{lo:.2g}, {hi:.2g}]; a cap that "
                         f"large is no cap (use None), one that small makes every score 0")
    return float(softcap)


def _check_alibi(slopes: Any, n: int, hq: int, lq: int, device: torch.device,
                 dtype: torch.dtype) -> Tensor:
    """ALiBi slopes ``(Hq,)``, ``(N|1, Hq)`` or per query row ``(N|1, Hq, Lq)`` (varlen:
    each row its sequence's slopes), as ``(N|1, Hq)`` or ``(N|1, Hq, Lq)``."""
    if not isinstance(slopes, Tensor):
        try:
            slopes = torch.as_tensor(slopes, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"alibi_slopes must be a float tensor or a list of floats (one "
                            f"per query head); got {type(slopes).__name__}") from err
    _check_device("alibi_slopes", slopes, device)
    if slopes.dtype == torch.bool or slopes.dtype.is_complex:
        raise TypeError(f"alibi_slopes must hold real numbers; got {slopes.dtype}")
    shapes = {(hq,), (1, hq), (n, hq), (1, hq, lq), (n, hq, lq)}
    if tuple(slopes.shape) not in shapes:
        raise ValueError(f"alibi_slopes must have shape ({hq},) or ({n}, {hq}) (or one row of "
                         f"slopes per query, ({n}, {hq}, {lq})); got {tuple(slopes.shape)}")
    slopes = slopes.to(dtype=dtype)
    return slopes.view(1, hq) if slopes.dim() == 1 else slopes


def _check_window(window: Any) -> Tuple[Optional[int], Optional[int]]:
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints or None; got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"window {side} size must be an int or None; got {w!r}")
        if w < 0:
            raise ValueError(
                f"window {side} size must be >= 0 (None for unbounded); got {w}")
        out.append(w)
    return out[0], out[1]


def _check_seqlens(name: str, x: Any, n: int, limit: int, device: torch.device) -> Tensor:
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x, device=device)
    _check_device(name, x, device)
    if x.dtype.is_floating_point or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of shape ({n},); got dtype {x.dtype}")
    if x.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) (one length per batch row); "
                         f"got {tuple(x.shape)}")
    x = x.to(device=device, dtype=torch.int64)
    if n and (int(x.min()) < 0 or int(x.max()) > limit):
        raise ValueError(f"{name} must lie in [0, {limit}]; got min {int(x.min())}, "
                         f"max {int(x.max())}")
    return x


#: Objects :func:`find_captured_tensors` visits at most (a guard against huge containers).
_VISIT_LIMIT = 100_000


def _code_names(code: Any) -> set:
    """Global and attribute names a code object (and the functions nested in it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def find_captured_tensors(fn: Any, _seen: Optional[set] = None) -> list:
    """Tensors that require grad and that a mod can reach: its closure cells, default
    arguments, the module globals its code names (and attributes it reads of global modules),
    the functions it calls through those, ``functools.partial`` arguments, a bound method's
    ``self`` or a callable object's attributes (``nn.Module`` parameters included), searched
    through lists, tuples, sets and dicts. They become explicit inputs of the autograd node, so
    gradients reach them."""
    seen = set() if _seen is None else _seen
    found: list = []

    def visit(obj: Any) -> None:
        if id(obj) in seen or len(seen) > _VISIT_LIMIT:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.requires_grad:
                found.append(obj)
            return
        if isinstance(obj, (type, types.ModuleType, str, bytes, int, float, complex, bool)):
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                visit(item)
            return
        if isinstance(obj, dict):
            for item in obj.values():
                visit(item)
            return
        if isinstance(obj, functools.partial):
            visit(obj.func)
            visit(obj.args)
            visit(obj.keywords)
            return
        if isinstance(obj, types.MethodType):
            visit(obj.__self__)
            visit(obj.__func__)
            return
        if isinstance(obj, types.FunctionType):
            if (obj.__module__ or "").split(".")[0] == "torch":
                return  # torch's own functions hold no user tensors
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents)
                except ValueError:  # empty cell
                    pass
            visit(obj.__defaults__ or ())
            visit(obj.__kwdefaults__ or {})
            names = _code_names(obj.__code__)
            for name in names:
                value = obj.__globals__.get(name)
                if isinstance(value, types.ModuleType):  # ``mod.table``: the attributes named
                    for attr in names:
                        visit(getattr(value, attr, None))
                else:
                    visit(value)
            return
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):  # a callable object, nn.Module, attnkit builtin
            visit(attrs)
            for klass in type(obj).__mro__:
                call = klass.__dict__.get("__call__")
                if call is not None:
                    visit(call)
                    break

    visit(fn)
    unique, ids = [], set()
    for t in found:
        if id(t) not in ids:
            ids.add(id(t))
            unique.append(t)
    return unique


def check_score_mod_gradients(score_mod: Callable[..., Tensor], params: Sequence[Tensor],
                              q: Tensor) -> None:
    """Call ``score_mod`` once on a 1 x 1 tile and walk the autograd graph of its result: a
    tensor that requires grad but is not among ``params`` (nor behind one of them) would get
    no gradient, so raise one error that says which tensor and how to pass it."""
    dev = q.device
    score = torch.zeros((1, 1, 1, 1), dtype=q.dtype, device=dev, requires_grad=True)
    idx = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=dev)
    try:
        with torch.enable_grad():
            out = score_mod(score, idx, idx, idx, idx)
    except Exception:  # noqa: BLE001 - the real evaluation reports the mod's own error
        return
    if not isinstance(out, Tensor) or out.grad_fn is None:
        return
    known = {id(p) for p in params} | {id(score)}
    stops = {p.grad_fn for p in params if p.grad_fn is not None}
    stack, visited, missing = [out.grad_fn], set(), []
    while stack and len(visited) < _VISIT_LIMIT:
        node = stack.pop()
        if node is None or node in visited or node in stops:
            continue
        visited.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if isinstance(var, Tensor) and id(var) not in known:
            missing.append(var)
        stack.extend(nxt for nxt, _ in node.next_functions)
    if missing:
        t = missing[0]
        raise ValueError(
            f"score_mod {getattr(score_mod, '__name__', type(score_mod).__name__)} uses a tensor "
            f"that requires grad (shape {tuple(t.shape)}, {t.dtype}) that attnkit cannot reach "
            f"from the function, so it would get no gradient; pass it through a closure, a "
            f"default argument or functools.partial (e.g. def mod(score, b, h, q, kv, "
            f"table=table)), or detach it if it needs no gradient")


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype torch's autocast casts to on ``device_type`` now, or None when it is off."""
    if device_type == "meta":
        return None  # (no autocast there; attnkit refuses meta inputs with its own error)
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        enabled = (torch.is_autocast_cpu_enabled() if device_type == "cpu"
                   else torch.is_autocast_enabled())
    if not enabled:
        return None
    try:
        return torch.get_autocast_dtype(device_type)
    except AttributeError:  # torch < 2.4
        return (torch.get_autocast_cpu_dtype() if device_type == "cpu"
                else torch.get_autocast_gpu_dtype())


def autocast_inputs(*xs: Any) -> Tuple[Any, ...]:
    """torch's autocast convention for SDPA (a lower-precision op): under an enabled
    ``torch.autocast`` every floating tensor argument but float64 is cast to the autocast dtype
    (q, k, v, an additive bias, sinks), so the call computes and returns in that dtype."""
    q = xs[0]
    dtype = autocast_dtype(q.device.type) if isinstance(q, Tensor) else None
    if dtype is None:
        return xs
    return tuple(x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point()
                 and x.dtype != torch.float64 else x for x in xs)


def _causal_bias_class() -> Optional[type]:
    """torch's ``CausalBias`` (``torch.nn.attention.bias``, torch >= 2.2), or None."""
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # pragma: no cover - older torch
        return None
    return CausalBias


def _check_plain_tensor(name: str, x: Any) -> None:
    """Refuse tensor subclasses attnkit cannot interpret (their storage may not hold what
    they mean). Parameters are plain tensors; torch's own tracing subclasses are allowed."""
    cls = type(x)
    if (not isinstance(x, Tensor) or cls is Tensor or isinstance(x, torch.nn.Parameter)
            or cls.__module__.startswith("torch._")):
        return
    raise TypeError(f"{name} is a {cls.__name__}, a torch.Tensor subclass attnkit cannot "
                    f"interpret; pass a plain tensor ({name}.as_subclass(torch.Tensor) if its "
                    f"storage holds the values you mean)")


def _absorb_causal_bias(name: str, x: Any, causal: Any, diagonal: str, lq: int, lk: int):
    """torch's ``CausalBias`` (``causal_upper_left`` / ``causal_lower_right``) as attnkit's
    ``causal=True`` with the matching diagonal: returns ``(causal, diagonal)``."""
    variant = x.variant.name  # UPPER_LEFT or LOWER_RIGHT
    if causal is True:
        raise ValueError(f"{name} is a torch CausalBias, which is already causal; it cannot be "
                         f"combined with causal=True (torch raises the same): drop one of them")
    if (x.seq_len_q, x.seq_len_kv) != (lq, lk):
        raise ValueError(f"{name} is a CausalBias for (seq_len_q, seq_len_kv) = "
                         f"{(x.seq_len_q, x.seq_len_kv)} but the inputs have {(lq, lk)}; build "
                         f"it with the inputs' lengths")
    want = "top_left" if variant == "UPPER_LEFT" else "bottom_right"
    if diagonal != "top_left" and diagonal != want:
        raise ValueError(f"{name} is a {variant.lower()} CausalBias but diagonal={diagonal!r}; "
                         f"leave diagonal out")
    return True, want


def _is_block_mask(x: Any) -> bool:
    return hasattr(x, "kv_num_blocks") and hasattr(x, "BLOCK_SIZE") and hasattr(x, "mask_mod")


def build_spec(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Any = None,
    mask: Any = None,
    bias: Optional[Tensor] = None,
    causal: bool = False,
    window: Any = None,
    diagonal: str = "top_left",
    score_mod: Optional[Callable[..., Tensor]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    seqlens_q: Any = None,
    seqlens_kv: Any = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    offset: int = 0,
    dropout_mask: Optional[Tensor] = None,
) -> AttentionSpec:
    """Validate the arguments of one call and normalise them into an :class:`AttentionSpec`."""
    causal_bias = _causal_bias_class()
    for name in ("mask", "bias"):
        x = mask if name == "mask" else bias
        if causal_bias is not None and isinstance(x, causal_bias):
            causal, diagonal = _absorb_causal_bias(name, x, causal, diagonal, q.shape[-2],
                                                   k.shape[-2])
            mask, bias = (None, bias) if name == "mask" else (mask, None)
    for name, x in (("q", q), ("k", k), ("v", v), ("mask", mask), ("bias", bias),
                    ("sinks", sinks), ("dropout_mask", dropout_mask)):
        _check_plain_tensor(name, x)
    qc, kc, vc, batch, squeeze = _canonical_qkv(q, k, v)
    n, hq, lq, d = qc.shape
    lk = kc.shape[2]
    spec = AttentionSpec(q=qc, k=kc, v=vc, batch_shape=batch, squeeze_heads=squeeze,
                         scale=_check_scale(scale, d))
    full = (hq, lq, lk)

    if diagonal not in ("top_left", "bottom_right"):
        raise ValueError(f"diagonal must be 'top_left' or 'bottom_right'; got {diagonal!r}")
    spec.diagonal = diagonal  # type: ignore[assignment]
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    left, right = _check_window(window)
    if causal:
        right = 0 if right is None else min(right, 0)
    spec.left, spec.right = _clamp_bound(left, lq, lk), _clamp_bound(right, lq, lk)
    for name, x in (("mask", mask), ("bias", bias), ("sinks", sinks),
                    ("dropout_mask", dropout_mask)):
        _check_device(name, x, qc.device)

    if mask is not None:
        if isinstance(mask, Tensor):
            if mask.dtype != torch.bool:
                raise TypeError(
                    f"mask must be a bool tensor (True = may attend); got dtype {mask.dtype}. "
                    f"For an additive float mask pass it as bias=")
            spec.mask = _canonical_4d("mask", mask, batch, n, full)
        elif _is_block_mask(mask):
            _check_block_mask(mask, n, hq, lq, lk)
            spec.block_mask = mask
        elif callable(mask):
            spec.mask_mod = mask
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
        spec.bias = _canonical_4d("bias", bias, batch, n, full)

    if score_mod is not None:
        if not callable(score_mod):
            raise TypeError(f"score_mod must be a callable (score, b, h, q_idx, kv_idx) -> "
                            f"score; got {type(score_mod).__name__}")
        spec.score_mod = score_mod
        spec.score_mod_params = tuple(find_captured_tensors(score_mod))
        if torch.is_grad_enabled():
            check_score_mod_gradients(score_mod, spec.score_mod_params, qc)

    if softcap is not None:
        spec.softcap = _check_softcap(softcap, spec.compute_dtype)

    if alibi_slopes is not None:
        spec.alibi_slopes = _check_alibi(alibi_slopes, n, hq, lq, qc.device, spec.compute_dtype)

    if seqlens_q is not None:
        spec.seqlens_q = _check_seqlens("seqlens_q", seqlens_q, n, lq, qc.device)
    if seqlens_kv is not None:
        spec.seqlens_kv = _check_seqlens("seqlens_kv", seqlens_kv, n, lk, qc.device)

    if sinks is not None:
        if not isinstance(sinks, Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks must be a float tensor of shape ({hq},)")
        if sinks.shape != (hq,):
            raise ValueError(f"sinks must have shape ({hq},) (one logit per query head); got "
                             f"{tuple(sinks.shape)}")
        spec.sinks = sinks
    _set_dropout(spec, dropout_p, seed, offset, dropout_mask, batch, full)
    if spec.mask_mod is not None:
        absorb_mask_structure(spec)  # last: it needs the final diagonal offsets
    return spec


def _set_dropout(spec: AttentionSpec, p: Any, seed: Any, offset: Any, keep: Any,
                 batch: Tuple[int, ...], full: Tuple[int, int, int]) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1]; got {p!r}")
    p = float(p)
    if not (0.0 <= p <= 1.0):  # also rejects NaN; 1 drops every weight (torch: zeros)
        raise ValueError(f"dropout_p must be in [0, 1]; got {p}")
    spec.dropout_p = p
    if keep is not None:
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
            raise TypeError("dropout_mask must be a bool tensor (True = keep) broadcastable to "
                            "the scores")
        spec.dropout_mask = _canonical_4d("dropout_mask", keep, batch, spec.n, full)
        return
    if p == 0.0:
        return
    from .dropout import _check_offset, _check_seed, draw_seed

    spec.seed = _check_seed(draw_seed() if seed is None else seed)
    spec.offset = _check_offset(offset)


def _check_block_mask(bm: Any, n: int, hq: int, lq: int, lk: int) -> None:
    seq = tuple(getattr(bm, "seq_lengths", (lq, lk)))
    if seq != (lq, lk):
        raise ValueError(f"the BlockMask was built for (Q_LEN, KV_LEN) = {seq} but the inputs "
                         f"have ({lq}, {lk}); rebuild it with create_block_mask")
    bb, bh = bm.kv_num_blocks.shape[:2]
    if bb not in (1, n) or bh not in (1, hq):
        raise ValueError(f"the BlockMask has batch {bb} and heads {bh}; expected 1 or {n} and "
                         f"1 or {hq}")


def absorb_mask_structure(spec: AttentionSpec) -> None:
    """Turn a builtin mask_mod's structure (causal/window bands, 1-D documents, padding, and
    ANDs of them) into analytic spec terms, so the planner skips and classifies tiles without
    evaluating the mask. When every part converts, the mask_mod is dropped; otherwise it stays
    (and is evaluated only on tiles the analytic terms leave alive)."""
    from .masks import structure_of

    st = structure_of(spec.mask_mod)
    if st is None:
        return
    _check_document_sizes(st, spec.lq, spec.lk)
    parts = st["parts"] if st.get("kind") == "and" else [st]
    converted = [_absorb_part(spec, part) for part in parts]
    if all(converted):
        spec.mask_mod = None


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


def _absorb_part(spec: AttentionSpec, st: Optional[dict]) -> bool:
    if st is None:
        return False
    kind = st.get("kind")
    if kind == "full":
        return True
    if kind in ("causal", "window"):
        off = spec.diag_offset()
        if spec.has_band or not isinstance(off, int) or spec.row_offset is not None:
            return False
        lo, hi = st["band"]  # visible iff lo <= j - i <= hi
        spec.left = None if lo is None else _clamp_bound(off - lo, spec.lq, spec.lk)
        spec.right = None if hi is None else _clamp_bound(hi - off, spec.lq, spec.lk)
        return True
    if kind == "document":
        ids_q, ids_kv = st["doc_ids_q"], st["doc_ids_kv"]
        if (spec.segments_q is not None or ids_q.dim() != 1 or ids_q.shape[0] != spec.lq
                or ids_kv.shape[0] != spec.lk):
            return False
        spec.segments_q = ids_q.to(spec.q.device, torch.int64)
        spec.segments_kv = ids_kv.to(spec.q.device, torch.int64)
        return True
    return False
