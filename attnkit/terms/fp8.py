"""fp8 attention inputs: quantization with cuDNN's suggested scale, and the checks and
dequantization that turn fp8 q, k, v and their descales into the spec's inputs.

An fp8 input stands for ``x8 * descale`` (cuDNN's and FlashAttention-3's convention). On the
CPU fp8 is a storage and bandwidth format (torch has no fp8 matmul worth using there), so
:func:`dequantize_inputs` turns fp8 q, k, v into the compute dtype once, per (batch, head), and
every executor, mask and score term then runs unchanged. Descales are float32 scalars (a
Python float or a 0-d tensor: one per tensor) or FlashAttention-3's per-(batch, kv head)
tensors ``(*B, Hkv)`` (q also takes ``(*B, Hq)``, what :func:`quantize_fp8` gives per head)::

    q8 (*B, Hq, Lq, D)  descale_q ()  or (*B, Hkv) or (*B, Hq)
    k8 (*B, Hkv, Lk, D) descale_k ()  or (*B, Hkv)
    v8 (*B, Hkv, Lk, Dv) descale_v () or (*B, Hkv)
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional, Tuple

import torch
from torch import Tensor

#: The fp8 formats attnkit reads: e4m3 (more precision, max 448) for activations, e5m2 (more
#: range, max 57344), by convention for gradients.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: The format the softmax weights are quantized to with ``p_scale`` (they lie in [0, 1]).
P_DTYPE = torch.float8_e4m3fn
#: What fp8 inputs are dequantized to when ``out_dtype`` does not say otherwise.
DEFAULT_COMPUTE = torch.bfloat16
_FLOAT = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
Granularity = Literal["tensor", "head"]


def is_fp8(x: Any) -> bool:
    """Whether ``x`` is a tensor (or a dtype) of one of :data:`FP8_DTYPES`."""
    dtype = x.dtype if isinstance(x, Tensor) else x
    return dtype in FP8_DTYPES


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def suggested_scale(amax: Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> Tensor:
    """cuDNN's suggested scale for values whose absolute maximum is ``amax``: the largest
    power of two not above ``max(dtype) / amax`` (so ``amax * scale`` fits and the scaling is
    exact). ``amax`` 0 gives 1 (nothing to scale). float32, ``amax``'s shape; the exponent is
    kept in [-126, 126] so the scale and its inverse stay normal float32 numbers."""
    amax = amax.float()
    top = torch.finfo(dtype).max
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    exponent = torch.floor(math.log2(top) - torch.log2(safe)).clamp(-126, 126)
    return torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax))


def quantize_fp8(x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                 granularity: Granularity = "tensor") -> Tuple[Tensor, Tensor]:
    """Quantize ``x`` to fp8 with cuDNN's suggested scale (:func:`suggested_scale`).

    Returns ``(x8, descale)`` with ``x8 = round(x * scale)`` in ``dtype`` and ``descale =
    1 / scale`` (float32), so ``x8 * descale`` approximates ``x`` (what :func:`attnkit.attention`
    takes as ``descale_q`` etc.). ``granularity="tensor"``: one scale, ``descale`` 0-d;
    ``"head"``: one per (batch, head) of a ``(*B, H, L, D)`` tensor, ``descale (*B, H)``
    (FlashAttention-3's layout). Values beyond the format's range cannot occur (the scale
    brings the maximum within it); infinities and NaN are refused.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"x must be a float tensor (float64, float32, bfloat16 or float16) to "
                        f"quantize; got {x.dtype}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2; got {dtype}")
    if granularity not in ("tensor", "head"):
        raise ValueError(f"granularity must be 'tensor' or 'head'; got {granularity!r}")
    if granularity == "head" and x.dim() < 3:
        raise ValueError(f"granularity='head' needs a (*B, H, L, D) tensor (one scale per "
                         f"batch row and head); got shape {tuple(x.shape)}. Use "
                         f"granularity='tensor'")
    xf = x.detach().float()
    if xf.numel() and not bool(torch.isfinite(xf).all()):
        raise ValueError("x holds inf or NaN; fp8 quantization needs finite values")
    if granularity == "tensor":
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
    else:
        amax = (xf.abs().amax(dim=(-2, -1)) if xf.shape[-2] * xf.shape[-1]
                else xf.new_zeros(xf.shape[:-2]))
    scale = suggested_scale(amax, dtype)
    per = scale if granularity == "tensor" else scale[..., None, None]
    x8 = cast_fp8(xf * per, dtype)
    return x8, 1.0 / scale


def cast_fp8(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` (already scaled) rounded to ``dtype``, saturating at the format's maximum (an
    e4m3fn overflow would otherwise be NaN)."""
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype)


def quantize_probabilities(p: Tensor, p_scale: float) -> Tensor:
    """The softmax weights as P V sees them with ``p_scale`` (cuDNN's ``scale_s``):
    ``fp8(p * p_scale) / p_scale`` in ``p``'s dtype (:data:`P_DTYPE`)."""
    return cast_fp8(p * p_scale, P_DTYPE).to(p.dtype) * (1.0 / p_scale)


# ---- checks and dequantization for attention() ------------------------------------------


def check_positive(name: str, value: Any) -> Optional[float]:
    """A finite float > 0 (a scale), or None."""
    if value is None:
        return None
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float > 0 or None; got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite float > 0; got {value}")
    return float(value)


#: What dP is rounded to with ``dp_scale`` (the gradients' format).
DP_DTYPE = torch.float8_e5m2


def quantize_dp(dp: Tensor, dp_scale: float) -> Tensor:
    """dP as the backward uses it with ``dp_scale`` (cuDNN's ``scale_dP``, with ``descale_dP
    = 1 / dp_scale``): ``fp8(dp * dp_scale) / dp_scale`` in e5m2 (:data:`DP_DTYPE`),
    saturating, in ``dp``'s dtype."""
    return cast_fp8(dp * dp_scale, DP_DTYPE).to(dp.dtype) * (1.0 / dp_scale)


def _check_scaled_dtype(arg: str, dtype: Any, scales: dict, stored: str, suggested: str,
                        fp8_hint: str) -> None:
    """``arg`` (a float or fp8 dtype, or None) and the scales of an fp8 ``arg`` (``scales``:
    name -> value; each required with an fp8 dtype, refused otherwise). ``stored`` says what
    a scale does (``{name}`` stands for it), ``suggested`` where a value comes from, and
    ``fp8_hint`` which fp8 dtype to pass."""
    if dtype is not None and (not isinstance(dtype, torch.dtype)
                              or dtype not in _FLOAT + FP8_DTYPES):
        raise TypeError(f"{arg} must be torch.bfloat16, torch.float32, torch.float16, "
                        f"torch.float64 or an fp8 dtype (with {', '.join(scales)}); "
                        f"got {dtype!r}")
    for name, value in scales.items():
        scale = check_positive(name, value)
        if dtype in FP8_DTYPES and scale is None:
            raise ValueError(f"{arg}={dtype} needs {name} ({stored.format(name=name)}); e.g. "
                             f"{name}=1.0, or the suggested scale of {suggested}")
        if scale is not None and dtype not in FP8_DTYPES:
            raise ValueError(f"{name} is for an fp8 {arg}; got {arg}={dtype}: pass "
                             f"{arg}={fp8_hint}, or drop {name}")


def check_out_dtype(out_dtype: Any, out_scale: Any) -> Tuple[Optional[torch.dtype],
                                                             Optional[float]]:
    """``out_dtype`` (a float or fp8 dtype, or None) and ``out_scale`` (required with an fp8
    ``out_dtype``, refused otherwise)."""
    _check_scaled_dtype("out_dtype", out_dtype, {"out_scale": out_scale},
                        "cuDNN's scale_o: the output is stored as fp8(out * out_scale)",
                        "the previous step's amax_o", "torch.float8_e4m3fn (or e5m2)")
    return out_dtype, check_positive("out_scale", out_scale)


def check_grad_dtype(grad_dtype: Any, scales: dict) -> None:
    """:func:`attnkit.attention_backward`'s ``grad_dtype`` (a float or fp8 dtype, or None) and
    its ``scale_dq``/``scale_dk``/``scale_dv`` (``scales``: name -> value; each required with
    an fp8 ``grad_dtype``, refused otherwise)."""
    _check_scaled_dtype("grad_dtype", grad_dtype, scales,
                        "cuDNN's scale for that gradient: it is stored as fp8(grad * {name})",
                        "the previous step's amax (return_amax=True)",
                        "torch.float8_e5m2 (or e4m3fn)")


def finish_output(out: Tensor, out_dtype: Optional[torch.dtype],
                  out_scale: Optional[float]) -> Tensor:
    """The output in ``out_dtype``: fp8 as ``fp8(out * out_scale)``, else a cast."""
    if out_dtype is None or out.dtype == out_dtype:
        return out
    if out_dtype in FP8_DTYPES:
        return cast_fp8(out.float() * out_scale, out_dtype)
    return out.to(out_dtype)


def dequantize_inputs(q: Any, k: Any, v: Any, descale_q: Any, descale_k: Any, descale_v: Any,
                      out_dtype: Optional[torch.dtype]) -> Tuple[Any, Any, Any]:
    """q, k, v as the spec computes them: unchanged when none is fp8; fp8 ones as
    ``x8 * descale`` in ``out_dtype`` (when it is a float dtype) or bfloat16."""
    xs = (("q", q, descale_q), ("k", k, descale_k), ("v", v, descale_v))
    fp8 = [name for name, x, _ in xs if isinstance(x, Tensor) and is_fp8(x)]
    if not fp8:
        for name, x, d in xs:
            if d is not None:
                got = _name(x.dtype) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"descale_{name} is for fp8 inputs (the real {name} is "
                                 f"{name}8 * descale_{name}); {name} is {got}: drop "
                                 f"descale_{name}, or pass {name} in float8_e4m3fn/e5m2")
        return q, k, v
    if len(fp8) < 3:
        other = [f"{name} {_name(x.dtype) if isinstance(x, Tensor) else type(x).__name__}"
                 for name, x, _ in xs if name not in fp8]
        raise TypeError(f"{', '.join(fp8)} {'is' if len(fp8) == 1 else 'are'} fp8 but "
                        f"{', '.join(other)}: q, k and v must all be fp8 (with descales) or "
                        f"all not; quantize the others with attnkit.quantize_fp8 or "
                        f"dequantize the fp8 ones ({fp8[0]}.float() * descale_{fp8[0]})")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one fp8 format; got q {_name(q.dtype)}, k "
                        f"{_name(k.dtype)}, v {_name(v.dtype)}. e4m3 is the format for "
                        f"activations (e5m2 is the convention for gradients): quantize all "
                        f"three with one dtype")
    missing = [f"descale_{name}" for name, _, d in xs if d is None]
    if missing:
        raise ValueError(f"fp8 inputs need their descales (the real q is q8 * descale_q); "
                         f"missing {', '.join(missing)}: pass the descale that "
                         f"attnkit.quantize_fp8 returned (1.0 if the values were not scaled)")
    for name, x, _ in xs:
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} is {_name(x.dtype)} and requires grad: a float8 tensor cannot hold "
                f"its gradient faithfully. Differentiate through the dequantized tensor "
                f"({name} = {name}8.to(torch.bfloat16) * descale_{name}), or use "
                f"attnkit.attention_backward, which returns gradients with respect to the "
                f"dequantized inputs in bfloat16/float32; descales may require grad")
    target = compute_dtype(out_dtype)
    hkv = k.shape[-3] if k.dim() >= 3 else 1
    return tuple(_dequantize(name, x, d, hkv, target) for name, x, d in xs)  # type: ignore


def compute_dtype(out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype fp8 inputs are computed in: ``out_dtype`` when it is a float dtype, else
    bfloat16."""
    return out_dtype if out_dtype in _FLOAT else DEFAULT_COMPUTE


def dequantize_query(q: Tensor, descale_q: Any, hkv: int,
                     out_dtype: Optional[torch.dtype]) -> Tensor:
    """fp8 ``q`` as :func:`dequantize_inputs` computes it (validated the same way)."""
    return _dequantize("q", q, descale_q, hkv, compute_dtype(out_dtype))


def cache_descales(name: str, x: Tensor, descale: Any) -> Tensor:
    """The descale of fp8 ``k`` or ``v`` ``(N, Hkv, L, D)`` (validated as
    :func:`dequantize_inputs` validates it) as one float32 per batch row and kv head,
    ``(N, Hkv)``: the per-(page, kv head) descales of its rows read as pages."""
    d = _check_descale(name, x, descale, x.shape[-3])
    return (d.expand(x.shape[0], x.shape[1]) if d.dim() == 0 else d).contiguous()


def _dequantize(name: str, x: Tensor, descale: Any, hkv: int, target: torch.dtype) -> Tensor:
    """``x8 * descale`` in ``target`` (the product in float32, rounded once): the native
    kernel's one pass where it can (torch's fp8 casts run one element at a time, a third of a
    bf16 prefill's time at L=4096), else torch ops (also where the descale needs a gradient);
    both give the same bits."""
    d = _check_descale(name, x, descale, hkv)
    if d.dim() and d.shape[-1] != x.shape[-3]:  # q's (*B, Hkv): each kv head's query group
        d = d.repeat_interleave(x.shape[-3] // d.shape[-1], dim=-1)
    if not (d.requires_grad and torch.is_grad_enabled()):
        from .. import native

        out = native.fp8_dequantize(x, d, target)
        if out is not None:
            return out
    return (x.to(torch.float32) * (d[..., None, None] if d.dim() else d)).to(target)


def _check_descale(name: str, x: Tensor, d: Any, hkv: int) -> Tensor:
    arg = f"descale_{name}"
    heads = x.shape[-3] if x.dim() >= 3 else None
    lead = tuple(x.shape[:-3]) if x.dim() >= 3 else ()
    shapes = ["()"]
    if heads is not None:
        shapes.append(f"{(*lead, hkv)} (batch, kv heads)")
        if name == "q" and heads != hkv:
            shapes.append(f"{(*lead, heads)} (batch, heads)")
    want = " or ".join(shapes)
    if isinstance(d, bool) or not isinstance(d, (int, float, Tensor)):
        raise TypeError(f"{arg} must be a float or a float32 tensor of shape {want}; got "
                        f"{type(d).__name__}")
    if not isinstance(d, Tensor):
        d = torch.tensor(float(d), dtype=torch.float32, device=x.device)
    if not d.dtype.is_floating_point or is_fp8(d):
        raise TypeError(f"{arg} must be a float32 tensor (or a float); got dtype {d.dtype}")
    if d.device != x.device:
        raise ValueError(f"{arg} is on {d.device} but {name} is on {x.device}; move it with "
                         f"{arg}.to({name}.device)")
    if d.numel() == 1 and d.dim() <= 1:
        d = d.reshape(())
    else:
        ok = heads is not None and tuple(d.shape[:-1]) == lead and (
            d.shape[-1] == hkv or (name == "q" and d.shape[-1] == heads))
        if not ok:
            raise ValueError(f"{arg} has shape {tuple(d.shape)}; expected {want} for {name} of "
                             f"shape {tuple(x.shape)}: one descale per tensor, or per batch "
                             f"row and key/value head (FlashAttention-3's layout)")
    if not bool(torch.isfinite(d).all()):
        raise ValueError(f"{arg} holds inf or NaN; descales must be finite")
    return d.float()
