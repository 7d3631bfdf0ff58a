"""attnkit's attention as ``torch.library`` custom ops, for ``torch.compile``.

``attnkit::attention`` (forward) and ``attnkit::attention_backward`` take only tensors and
scalars: q, k, v, the optional tensors of a call in the fixed order of :data:`SLOTS` (bias,
bool mask, sinks, ALiBi slopes, padding lengths, segment ids, paged K/V, block tables and fp8
page descales,
BlockMask index tensors, a dropout keep mask or seed), the tensors of builtin mask_mods and
score_mods (a builtin is carried as its recipe: its factory and arguments, see
:attr:`attnkit.mods.Builtin.recipe`) and a JSON string of the static options. Inside, on real
tensors, the call is validated and normalised by :func:`attnkit.spec.build_spec` exactly as in
eager mode, the planner runs, and the same executor as in eager mode computes it; the fake
kernels say only the output shapes, so a compiled graph holds one opaque call per attention.
``register_autograd`` wires the backward op, so the one autograd node stays the one backward;
a backward that is itself differentiated (``create_graph=True``) runs the differentiable torch
ops of the executor that declares them (``Capabilities.extras``) instead.

The front doors call these ops when torch.compile traces them
(``torch.compiler.is_compiling()``); in eager mode they call the same executors through the
same autograd node directly, which costs about a third of a custom op's dispatch per call (see
docs/guides/compile.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

#: The optional tensors of a call that get no gradient, in the order the ops take them.
SLOTS = ("mask", "alibi_slopes", "seqlens_q", "seqlens_kv", "starts_kv", "dropout_mask", "seed",
         "segments_q", "segments_kv", "row_offset", "k_pages", "v_pages", "block_table",
         "cu_seqlens_q", "cu_seqlens_kv", "bm_kv_num_blocks", "bm_kv_indices",
         "bm_full_kv_num_blocks", "bm_full_kv_indices", "k_descale", "v_descale",
         "descale_q", "descale_k", "descale_v")
#: Options whose tensors may get a gradient; they travel with the mods' tensors in the ops'
#: ``grad_tensors`` list (the config names which are present).
GRAD_OPTIONS = ("bias", "sinks")

#: How each option of :class:`attnkit.spec.Options` travels through the ops, by name:
#: ``"value"`` a JSON value in the config (a window's tuple as a list), ``"dtype"`` a dtype
#: by its name in the config, ``"slot"`` a tensor in its slot of :data:`SLOTS` (numbers and
#: lists become tensors), ``"number_or_slot"`` a number in the config or a tensor in its slot,
#: ``"grad"`` a tensor that may get a gradient (:data:`GRAD_OPTIONS`), ``"mask"`` (a tensor, a
#: BlockMask or a builtin mask_mod's recipe), ``"score_mod"`` (a builtin's recipe) and
#: ``"seed"`` (a tensor drawn per call when None). :func:`pack` and :func:`unpack` walk it
#: for every option there is: an option it does not name cannot be packed (``pack`` refuses
#: a call that sets it), so an option added to ``Options`` fails the compile tests until it
#: is carried here.
CARRY = {"scale": "value", "mask": "mask", "bias": "grad", "causal": "value",
         "window": "value", "diagonal": "value", "score_mod": "score_mod", "softcap": "value",
         "alibi_slopes": "slot", "seqlens_q": "slot", "seqlens_kv": "slot",
         "starts_kv": "slot", "sinks": "grad", "dropout_p": "value", "seed": "seed",
         "offset": "value", "dropout_mask": "slot", "descale_q": "number_or_slot",
         "descale_k": "number_or_slot", "descale_v": "number_or_slot", "p_scale": "value",
         "out_dtype": "dtype", "out_scale": "value"}


def revision(source: str) -> str:
    """The ops' revision for their source text: attnkit's version and a hash of the source."""
    from .. import __version__

    return __version__ + "+" + hashlib.sha256(source.encode()).hexdigest()[:12]


def _own_source() -> str:
    try:
        with open(os.path.abspath(__file__), encoding="utf-8") as f:
            return f.read()
    except OSError:  # no source shipped: the version alone
        return ""


#: Carried in every op call's config. torch's on-disk graph caches key a compiled graph by its
#: code and constants, not by a custom op's fake kernel, so a graph compiled against another
#: revision of these ops (whose fake kernels may have said other shapes or strides) must not
#: match: the revision is one of the graph's constants.
OP_REVISION = revision(_own_source())


# ---- packing a call (runs in the traced front door: no data is read) ------------------------


class Packed:
    """One call as op arguments: ``grad_tensors`` (bias and sinks where given, then the
    builtin mods' tensors), ``tensors`` (one per slot of :data:`SLOTS`, None where unused)
    and the JSON ``config``."""

    def __init__(self) -> None:
        self.slots: Dict[str, Optional[Tensor]] = dict.fromkeys(SLOTS)
        self.options: Dict[str, Tensor] = {}  # bias / sinks
        self.mod_tensors: List[Tensor] = []
        self.config: Dict[str, Any] = {}

    @property
    def tensors(self) -> List[Optional[Tensor]]:
        return [self.slots[name] for name in SLOTS]

    @property
    def grad_tensors(self) -> List[Tensor]:
        return [self.options[name] for name in GRAD_OPTIONS if name in self.options] + list(
            self.mod_tensors)

    def recipe(self, mod: Any, what: str) -> Dict[str, Any]:
        """A builtin mod's recipe with its tensors appended to ``mod_tensors``."""
        recipe = getattr(mod, "recipe", None)
        if recipe is None:
            raise NotImplementedError(f"{what} {getattr(mod, '__name__', mod)!r} is not an "
                                      f"attnkit builtin, so it cannot be passed to a compiled "
                                      f"attention op")
        tree, tensors = recipe
        base = len(self.mod_tensors)
        self.mod_tensors.extend(tensors)
        return {"tree": tree, "base": base, "count": len(tensors)}


def pack(door: str, q: Tensor, k: Tensor, v: Tensor, options: Any, *, backend: str,
         outputs: Sequence[str] = (), extra: Optional[Dict[str, Any]] = None) -> Packed:
    """``options`` (an :class:`attnkit.spec.Options`) and the door's own tensors (``extra``:
    segments, pages, cu_seqlens ...) as op arguments, every option as :data:`CARRY` says.
    Shape-only work: safe to trace."""
    from ..terms.spec import _DEFAULT_OPTIONS, _is_default

    p = Packed()
    cfg = p.config
    cfg.update(rev=OP_REVISION, door=door, backend=backend, outputs=list(outputs))
    values: Dict[str, Any] = {}
    for name in options.names():
        x = getattr(options, name)
        how = CARRY.get(name)
        if how is None:
            if not _is_default(x, getattr(_DEFAULT_OPTIONS, name)):
                raise NotImplementedError(f"the option {name!r} is not carried through the "
                                          f"compiled attention op (attnkit.ops.CARRY)")
        elif how == "value":
            values[name] = list(x) if isinstance(x, tuple) else x
        elif how == "dtype":
            values[name] = None if x is None else str(x).replace("torch.", "")
        elif how == "slot":
            p.slots[name] = _as_tensor(x, q, torch.float32 if name == "alibi_slopes" else None)
        elif how == "number_or_slot":
            if isinstance(x, Tensor):
                p.slots[name] = x
            else:
                values[name] = x
        elif how == "grad":
            if x is not None:
                p.options[name] = _as_tensor(x, q)
        elif how == "seed":
            if options.dropout_p > 0.0 and options.dropout_mask is None:
                p.slots["seed"] = _seed_tensor(x, q.device)
        elif how == "mask":
            _pack_mask(p, x)
        elif how == "score_mod":
            if x is not None:
                cfg["score_mod"] = p.recipe(x, "score_mod")
    cfg["values"] = values
    cfg["options"] = [name for name in GRAD_OPTIONS if name in p.options]
    for name, value in (extra or {}).items():
        p.slots[name] = value
    return p


def _pack_mask(p: Packed, mask: Any) -> None:
    """A bool mask into its slot, a BlockMask's tensors into theirs, a builtin mask_mod as
    its recipe."""
    if isinstance(mask, Tensor):
        p.slots["mask"] = mask
    elif hasattr(mask, "kv_num_blocks"):  # a BlockMask
        from ..terms.block_mask import BlockMask

        bm = mask if isinstance(mask, BlockMask) else BlockMask.from_torch(mask)
        p.slots["bm_kv_num_blocks"], p.slots["bm_kv_indices"] = bm.kv_num_blocks, bm.kv_indices
        p.slots["bm_full_kv_num_blocks"] = bm.full_kv_num_blocks
        p.slots["bm_full_kv_indices"] = bm.full_kv_indices
        p.config["block_mask"] = {"BLOCK_SIZE": list(bm.BLOCK_SIZE),
                                  "seq_lengths": list(bm.seq_lengths),
                                  "mask_mod": None if bm.mask_mod is None
                                  else p.recipe(bm.mask_mod, "the BlockMask's mask_mod")}
    elif mask is not None:
        p.config["mask_mod"] = p.recipe(mask, "mask")


def _as_tensor(x: Any, like: Tensor, dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    if x is None or isinstance(x, Tensor):
        return x
    return torch.as_tensor(x, dtype=dtype, device=like.device)


def _seed_tensor(seed: Optional[int], device: torch.device) -> Tensor:
    """The Philox seed as two int64 words (lo, hi), drawn from torch's generator as a tensor
    when None (so a compiled graph draws a new one each call)."""
    if seed is None:
        return torch.randint(0, 2 ** 31, (2,), dtype=torch.int64, device=device)
    return torch.tensor([seed & 0xFFFFFFFF, seed >> 32], dtype=torch.int64, device=device)


# ---- unpacking (runs inside the op, on real tensors) ----------------------------------------


def _split(grad_tensors: Sequence[Tensor], cfg: Dict[str, Any]
           ) -> Tuple[Dict[str, Tensor], Sequence[Tensor]]:
    names = cfg["options"]
    return dict(zip(names, grad_tensors[:len(names)])), grad_tensors[len(names):]


def _mod(cfg: Optional[Dict[str, Any]], mod_tensors: Sequence[Tensor]) -> Any:
    if cfg is None:
        return None
    from ..terms.mods import from_recipe

    return from_recipe(cfg["tree"], mod_tensors[cfg["base"]:cfg["base"] + cfg["count"]])


def unpack(q: Tensor, k: Tensor, v: Tensor, grad_tensors: Sequence[Tensor],
           tensors: Sequence[Optional[Tensor]], cfg: Dict[str, Any]) -> Any:
    """The :class:`attnkit.spec.AttentionSpec` of an op call (validated by ``build_spec``) from
    its arguments and parsed config. Tensors that the call differentiates (the config's
    ``grads``) are marked as requiring grad (an op's inputs arrive detached), so the spec has
    the learnable terms of eager mode."""
    from ..terms.spec import Options, PagedKV, build_spec

    wants = set(cfg.get("grads", ()))
    grad_tensors = [t.detach().requires_grad_(True) if i in wants else t
                    for i, t in enumerate(grad_tensors)]
    named, mod_tensors = _split(grad_tensors, cfg)
    t = dict(zip(SLOTS, tensors))
    mask: Any = t["mask"]
    if cfg.get("block_mask") is not None:
        from ..terms.block_mask import BlockMask

        bmc = cfg["block_mask"]
        mask = BlockMask.from_kv_blocks(
            t["bm_kv_num_blocks"], t["bm_kv_indices"], t["bm_full_kv_num_blocks"],
            t["bm_full_kv_indices"], BLOCK_SIZE=tuple(bmc["BLOCK_SIZE"]),
            mask_mod=_mod(bmc["mask_mod"], mod_tensors), seq_lengths=tuple(bmc["seq_lengths"]),
            compute_q_blocks=False)
    elif cfg.get("mask_mod") is not None:
        mask = _mod(cfg["mask_mod"], mod_tensors)
    opts = Options(**_unpacked_options(cfg, t, named, mask, mod_tensors))
    door = cfg["door"]
    extra: Dict[str, Any] = {"outputs": frozenset(cfg["outputs"])}
    if door == "varlen":
        from ..terms.checks import check_cu

        check_cu("cu_seqlens_q", t["cu_seqlens_q"], q.shape[2], q.device)
        check_cu("cu_seqlens_kv", t["cu_seqlens_kv"], k.shape[2], q.device)
        extra.update(segments=(t["segments_q"], t["segments_kv"]), row_offset=t["row_offset"])
    elif door == "paged":
        from ..kv.pages import _check_pages

        lens = _check_pages(t["k_pages"], t["v_pages"], t["block_table"], t["seqlens_kv"])
        opts = opts.merged(seqlens_kv=lens)
        extra["paged"] = PagedKV(t["k_pages"], t["v_pages"], t["block_table"].long(),
                                 t["k_descale"], t["v_descale"])
    return build_spec(q, k, v, opts, **extra), grad_tensors


def _unpacked_options(cfg: Dict[str, Any], t: Dict[str, Optional[Tensor]],
                      named: Dict[str, Tensor], mask: Any,
                      mod_tensors: Sequence[Tensor]) -> Dict[str, Any]:
    """Every option of a packed call by name, read back as :data:`CARRY` says."""
    from ..terms.spec import Options

    values = cfg["values"]
    out: Dict[str, Any] = {}
    for name in Options.names():
        how = CARRY.get(name)
        if how == "value" and name in values:
            x = values[name]
            out[name] = tuple(x) if isinstance(x, list) else x
        elif how == "dtype" and values.get(name) is not None:
            out[name] = getattr(torch, values[name])
        elif how == "slot":
            out[name] = t[name]
        elif how == "number_or_slot":
            out[name] = t[name] if t[name] is not None else values.get(name)
        elif how == "grad":
            out[name] = named.get(name)
        elif how == "seed" and t["seed"] is not None:
            lo, hi = (int(x) for x in t["seed"].tolist())
            out[name] = lo | (hi << 32)
        elif how == "mask":
            out[name] = mask
        elif how == "score_mod":
            out[name] = _mod(cfg.get("score_mod"), mod_tensors)
    return out


def stand_ins(k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
              dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """Zero-stride K/V of the gathered shape (B, Hkv, W * page, D) over paged K/V (so a paged
    call is validated as a dense one; nothing is allocated), in the pages' dtype or ``dtype``
    (fp8 pages: the dtype they are computed in)."""
    bsz, width = block_table.shape
    _, page, hkv, d = k_pages.shape
    dtype = k_pages.dtype if dtype is None else dtype
    return (k_pages.new_zeros((), dtype=dtype).expand(bsz, hkv, width * page, d),
            v_pages.new_zeros((), dtype=dtype).expand(bsz, hkv, width * page, v_pages.shape[3]))


# ---- the ops ----------------------------------------------------------------------------------


def _output_shapes(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(out, lse) shapes of a call, from the shapes alone."""
    if q.dim() == 2:
        return (q.shape[0], v.shape[-1]), (q.shape[0],)
    batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    return (*batch, q.shape[-3], q.shape[-2], v.shape[-1]), (*batch, q.shape[-3], q.shape[-2])


def _out_dtype(q: Tensor, cfg: Dict[str, Any]) -> torch.dtype:
    """The op's ``out`` dtype: q's, or for fp8 inputs the dtype they are dequantized into
    (:func:`attnkit.fp8.dequantize_inputs`: a float ``out_dtype``, else bfloat16). The front
    door converts it to ``out_dtype`` afterwards."""
    from ..terms.fp8 import is_fp8

    if not is_fp8(q):
        return q.dtype
    name = cfg["values"].get("out_dtype")
    dtype = None if name is None else getattr(torch, name)
    return dtype if dtype is not None and not is_fp8(dtype) else torch.bfloat16


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("attnkit::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, grad_tensors: List[Tensor],
                 tensors: List[Optional[Tensor]], config: str
                 ) -> Tuple[Tensor, Tensor, Tensor]:
    """The forward: ``(out, lse, max_scores)`` in the call's shapes (contiguous;
    ``max_scores`` is empty unless the config asks for it)."""
    from .. import backends

    cfg = json.loads(config)
    spec, _ = unpack(q, k, v, grad_tensors, tensors, cfg)
    executor = backends.select(spec, cfg["backend"])
    with torch.no_grad():
        res = executor.forward(spec, executor.make_plan(spec))
    out = res.out.to(spec.q.dtype).reshape(spec.output_shape(spec.dv)).contiguous()
    lse = res.lse.to(_lse_dtype(q)).reshape(spec.lse_shape()).contiguous()
    if "max_scores" not in spec.outputs:  # (not computed: an empty tensor, not a NaN one)
        return out, lse, q.new_empty(0, dtype=_lse_dtype(q))
    mx = res.max_scores.to(_lse_dtype(q)).reshape(spec.lse_shape()).contiguous()
    return out, lse, mx


@attention_op.register_fake
def _attention_fake(q, k, v, grad_tensors, tensors, config):
    cfg = json.loads(config)
    out_shape, lse_shape = _output_shapes(q, k, v)
    mx_shape = lse_shape if "max_scores" in cfg["outputs"] else (0,)
    return (q.new_empty(out_shape, dtype=_out_dtype(q, cfg)),
            q.new_empty(lse_shape, dtype=_lse_dtype(q)),
            q.new_empty(mx_shape, dtype=_lse_dtype(q)))


def _grads(spec: Any, g: Any, q: Tensor, k: Tensor, v: Tensor, grad_tensors: Sequence[Tensor],
           marked: Sequence[Tensor], cfg: Dict[str, Any]) -> List[Tensor]:
    """``[dq, dk, dv, *d(grad_tensors)]`` in the inputs' shapes; an empty tensor for an input
    the call does not differentiate."""
    from .autograd import unbroadcast, unbroadcast_input

    res = [unbroadcast_input(g.dq, spec, q).to(q.dtype),
           unbroadcast_input(g.dk, spec, k).to(k.dtype),
           unbroadcast_input(g.dv, spec, v).to(v.dtype)]
    names = cfg["options"]
    wants = set(cfg.get("grads", ()))
    by_id = {id(p): dp for p, dp in zip(spec.score_mod_params, g.dparams)}
    for i, (orig, m) in enumerate(zip(grad_tensors, marked)):
        name = names[i] if i < len(names) else None
        if name == "bias":
            d = None if g.dbias is None else unbroadcast(g.dbias, spec, orig.shape)
        elif name == "sinks":
            d = g.dsinks
        else:
            d = by_id.get(id(m))
        res.append(q.new_empty(0) if d is None or i not in wants else d.to(orig.dtype))
    return res


@torch.library.custom_op("attnkit::attention_backward", mutates_args=())
def attention_backward_op(q: Tensor, k: Tensor, v: Tensor, grad_tensors: List[Tensor],
                          tensors: List[Optional[Tensor]], config: str, out: Tensor,
                          lse: Tensor, dout: Tensor, dlse: Optional[Tensor]) -> List[Tensor]:
    """The backward: ``[dq, dk, dv, *d(grad_tensors)]``, contiguous in the inputs' shapes
    (empty where not differentiated)."""
    from .. import backends

    cfg = json.loads(config)
    spec, marked = unpack(q, k, v, grad_tensors, tensors, cfg)
    executor = backends.select(spec, cfg["backend"])
    canon = (spec.n, spec.hq, spec.lq)
    if dlse is not None and not bool(dlse.any()):
        # a compiled graph materialises the unused lse output's gradient as zeros; dropped as
        # the eager node drops it (the fused backward would carry it in an extra head column)
        dlse = None
    g = executor.backward(spec, executor.make_plan(spec), out.reshape(*canon, spec.dv),
                          lse.reshape(canon), dout.reshape(*canon, spec.dv),
                          None if dlse is None else dlse.reshape(canon))
    res = _grads(spec, g, q, k, v, grad_tensors, marked, cfg)
    # contiguous, as the fake kernel says; outputs of a custom op may not alias each other or
    # an input
    res = [x.contiguous() for x in res]
    return [x.clone() if x._base is not None or any(x is y for y in (q, k, v)) else x
            for x in res]


@attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, grad_tensors, tensors, config, out, lse, dout, dlse):
    wants = set(json.loads(config).get("grads", ()))
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)] + [
        t.new_empty(t.shape) if i in wants else q.new_empty(0)
        for i, t in enumerate(grad_tensors)]


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, ...]) -> None:
    q, k, v, grad_tensors, tensors, config = inputs
    out, lse, _ = output
    ctx.config = config
    ctx.has = [t is not None for t in tensors]
    ctx.n_grad = len(grad_tensors)
    ctx.save_for_backward(q, k, v, out, lse, *grad_tensors,
                          *[t for t in tensors if t is not None])


def _op_backward(ctx: Any, dout: Tensor, dlse: Tensor, _dmax: Tensor):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    grad_tensors = list(rest[:ctx.n_grad])
    it = iter(rest[ctx.n_grad:])
    tensors = [next(it) if has else None for has in ctx.has]
    if dout is None:
        dout = torch.zeros_like(out)
    if torch.is_grad_enabled():  # create_graph: the differentiable torch-ops backward
        grads = _differentiable_backward(q, k, v, grad_tensors, tensors, ctx.config, out, lse,
                                         dout, dlse)
    else:
        grads = attention_backward_op(q, k, v, grad_tensors, tensors, ctx.config, out, lse,
                                      dout, dlse)
    dq, dk, dv, *dg = grads
    return dq, dk, dv, [_none_if_empty(d, t) for d, t in zip(dg, grad_tensors)], None, None


def _none_if_empty(d: Tensor, like: Tensor) -> Optional[Tensor]:
    return None if d.shape != like.shape else d


def _differentiable_backward(q: Tensor, k: Tensor, v: Tensor, grad_tensors: Sequence[Tensor],
                             tensors: Sequence[Optional[Tensor]], config: str, out: Tensor,
                             lse: Tensor, dout: Tensor, dlse: Optional[Tensor]) -> List[Tensor]:
    """The backward in differentiable torch ops (the executor with the
    ``"differentiable_backward"`` extra), outside any op (so it is itself differentiable):
    used for double backward. The mods are rebuilt on the saved tensors
    themselves, so second derivatives reach them."""
    from .. import backends

    cfg = json.loads(config)
    cfg.pop("grads", None)  # the saved tensors carry their own requires_grad
    spec, marked = unpack(q, k, v, grad_tensors, tensors, cfg)
    canon = (spec.n, spec.hq, spec.lq)
    executor = backends.with_extra("differentiable_backward", spec)
    g = executor.backward(spec, executor.make_plan(spec), out.reshape(*canon, spec.dv),
                       lse.reshape(canon), dout.reshape(*canon, spec.dv),
                       None if dlse is None else dlse.reshape(canon))
    cfg["grads"] = list(range(len(grad_tensors)))
    return _grads(spec, g, q, k, v, grad_tensors, marked, cfg)


torch.library.register_autograd("attnkit::attention", _op_backward,
                                setup_context=_setup_context)


def _to_json(x: Any) -> str:
    """JSON of plain values (dicts, lists, strings, numbers, bools, None), in code that
    torch.compile traces (``json.dumps`` is a C encoder it cannot)."""
    if x is None:
        return "null"
    if x is True:
        return "true"
    if x is False:
        return "false"
    if isinstance(x, str):
        return '"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_to_json(item) for item in x) + "]"
    if isinstance(x, dict):
        return "{" + ",".join(_to_json(str(key)) + ":" + _to_json(x[key])
                              for key in sorted(x)) + "}"
    raise TypeError(f"cannot write a {type(x).__name__} into an op's config")


def call(p: Packed, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Run a packed call through the op: which inputs need gradients goes into the config."""
    grads = [i for i, t in enumerate(p.grad_tensors) if t.requires_grad]
    if grads:
        p.config["grads"] = grads
    return attention_op(q, k, v, p.grad_tensors, p.tensors, _to_json(p.config))


def is_compiling() -> bool:
    """Whether torch.compile (or export) is tracing the caller."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check()) if check is not None else False
