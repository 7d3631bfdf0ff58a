"""Argument checks shared by every front door: each raises ``TypeError``/``ValueError`` naming
the argument, what was expected, what was given and the fix (never an ``assert``)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def compute_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """The dtype attnkit computes in for inputs of ``dtype``: float64 for float64, else
    float32 (half-precision inputs are computed in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_int(name: str, value: Any, minimum: Optional[int] = None, *,
              allow_none: bool = False, fix: str = "") -> Optional[int]:
    """``value`` as an int (bools refused), at least ``minimum``; None passes with
    ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        expected = "an int or None" if allow_none else "an int"
        raise TypeError(
            f"{name} must be {expected}, got {type(value).__name__} ({value!r}). {fix}".rstrip())
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}. {fix}".rstrip())
    return value


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


def check_float_tensor(name: str, x: Any) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; attention needs a floating dtype "
            f"(float64, float32, bfloat16 or float16): convert with {name}.float()")
    if x.dim() < 2:
        raise ValueError(
            f"{name} must have at least 2 dims (L, D); got shape {tuple(x.shape)}")
    return x


def check_scale(scale: Any, d: int) -> float:
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


def clamp_bound(w: Optional[int], lq: int, lk: int) -> Optional[int]:
    """A window bound (any int, None = unbounded) clamped to +-(Lq + Lk + 1): every bound
    beyond that has the same meaning, and the planner's integer arithmetic stays small."""
    if w is None:
        return None
    limit = lq + lk + 1
    return max(-limit, min(limit, w))


def check_device(name: str, x: Any, device: torch.device) -> None:
    if isinstance(x, Tensor) and x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; move it with "
                         f"{name}.to(q.device)")


#: Softcaps float32 computes reliably (the tiled executor divides the query scale by the cap).
SOFTCAP_RANGE = (2.0 ** -60, 2.0 ** 60)


def check_softcap(softcap: Any, compute: torch.dtype) -> float:
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


def check_alibi(slopes: Any, n: int, hq: int, lq: int, device: torch.device,
                 dtype: torch.dtype) -> Tensor:
    """ALiBi slopes ``(Hq,)``, ``(N|1, Hq)`` or per query row ``(N|1, Hq, Lq)`` (varlen:
    each row its sequence's slopes), as ``(N|1, Hq)`` or ``(N|1, Hq, Lq)``."""
    if not isinstance(slopes, Tensor):
        try:
            slopes = torch.as_tensor(slopes, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"alibi_slopes must be a float tensor or a list of floats (one "
                            f"per query head); got {type(slopes).__name__}") from err
    check_device("alibi_slopes", slopes, device)
    if slopes.dtype == torch.bool or slopes.dtype.is_complex:
        raise TypeError(f"alibi_slopes must hold real numbers; got {slopes.dtype}")
    shapes = {(hq,), (1, hq), (n, hq), (1, hq, lq), (n, hq, lq)}
    if tuple(slopes.shape) not in shapes:
        raise ValueError(f"alibi_slopes must have shape ({hq},) or ({n}, {hq}) (or one row of "
                         f"slopes per query, ({n}, {hq}, {lq})); got {tuple(slopes.shape)}")
    slopes = slopes.to(dtype=dtype)
    return slopes.view(1, hq) if slopes.dim() == 1 else slopes


def check_window(window: Any) -> Tuple[Optional[int], Optional[int]]:
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


def check_seqlens(name: str, x: Any, n: int, limit: int, device: torch.device) -> Tensor:
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x, device=device)
    check_device(name, x, device)
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
    return tuple(x.to(dtype) if isinstance(x, Tensor) and x.dtype in FLOAT_DTYPES
                 and x.dtype != torch.float64 else x for x in xs)  # (fp8: by its descale)


def causal_bias_class() -> Optional[type]:
    """torch's ``CausalBias`` (``torch.nn.attention.bias``, torch >= 2.2), or None."""
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # pragma: no cover - older torch
        return None
    return CausalBias


def check_plain_tensor(name: str, x: Any) -> None:
    """Refuse tensor subclasses attnkit cannot interpret (their storage may not hold what
    they mean). Parameters are plain tensors; torch's own tracing subclasses are allowed."""
    cls = type(x)
    if (not isinstance(x, Tensor) or cls is Tensor or isinstance(x, torch.nn.Parameter)
            or cls.__module__.startswith("torch._")):
        return
    raise TypeError(f"{name} is a {cls.__name__}, a torch.Tensor subclass attnkit cannot "
                    f"interpret; pass a plain tensor ({name}.as_subclass(torch.Tensor) if its "
                    f"storage holds the values you mean)")


def causal_bias_as_causal(name: str, x: Any, causal: Any, diagonal: str, lq: int, lk: int):
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


def check_cu(name: str, cu: Any, total: int, device: torch.device) -> Tensor:
    """``cu_seqlens`` (a tensor or list of ints) checked: 1-D int prefix sums from 0 to
    ``total`` on ``device``; returned as int64."""
    if isinstance(cu, (list, tuple)):
        try:
            cu = torch.as_tensor(cu, device=device)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{name} must be an int32/int64 tensor or a list of ints") from err
        if cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32/int64 tensor or a list of ints; got a "
                            f"list of {cu.dtype} values")
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be an int32/int64 tensor or a list of ints; got "
                        f"{type(cu).__name__}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}; move it with "
                         f"{name}.to(q.device)")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64; got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D prefix sums with a leading 0; got shape "
                         f"{tuple(cu.shape)}")
    cu = cu.to(device=device, dtype=torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start with 0; got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (lengths >= 0); got {cu.tolist()}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name} ends at {int(cu[-1])} but the packed tensor holds {total} "
                         f"tokens; the last entry must equal the total length")
    return cu
