"""What attnkit knows about its builtin mask_mods and score_mods, and how it re-indexes mods.

A builtin (``masks.causal()``, ``score_mods.alibi(...)``, ...) is a :class:`Builtin`: a named
callable that carries a frozen :class:`ModInfo` describing it (a mask's structure, a score
mod's additive bias or softcap), so executors can run it without calling it element by
element. The description is trusted only on genuine builtins: ``functools.wraps`` copies
attributes onto a wrapper, but the wrapper is a plain function, so :func:`info_of` returns
None for it and the wrapper is evaluated as the user wrote it.

Builtins pickle (and ``torch.save``) by their factory and arguments: ``masks.causal()``
unpickles as ``masks.causal()`` again.

:func:`remap` is the one re-indexing helper: the fused executor runs a batch row on its own
(``b -> b + b0``), varlen hands a mod per-sequence positions, ring attention global ones. A
builtin stays a builtin through it, with its bias re-indexed the same way.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["Builtin", "ModInfo", "call_mask_mod", "call_score_mod", "check_score_mod_gradients",
           "find_captured_tensors", "from_recipe", "info_of", "remap"]

IndexMap = Callable[[Tensor, Tensor, Tensor, Tensor], Tuple[Tensor, Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class ModInfo:
    """A builtin mod's description.

    ``structure``: the documented plain dict (see :mod:`attnkit.masks` and
    :mod:`attnkit.score_mods`); ``bias``: for an additive score mod, ``fn(b, h, q_idx, kv_idx)``
    with ``mod(score, b, h, q, k) == score + fn(b, h, q, k).to(score.dtype)``; ``cap``: the cap
    of a softcap score mod."""

    structure: Mapping[str, Any] = field(default_factory=dict)
    bias: Optional[Callable[..., Tensor]] = None
    cap: Optional[float] = None

    @property
    def kind(self) -> Optional[str]:
        return self.structure.get("kind")


class Builtin:
    """A builtin mod: calls ``fn``, is named ``name``, described by ``info``, and pickles as
    ``factory(*args)`` (``factory=None``: a module-level object pickled by its name)."""

    def __init__(self, fn: Callable[..., Tensor], name: str, info: ModInfo,
                 factory: Optional[Callable[..., Any]] = None, args: Tuple[Any, ...] = (),
                 module: str = "attnkit") -> None:
        self._fn = fn
        self._info = info
        self._factory = factory
        self._args = args
        self.__name__ = self.__qualname__ = name
        self.__module__ = module
        self.__doc__ = fn.__doc__
        self._recipe = _recipe_of(self)  # (made now: code that torch.compile traces reads it)

    @property
    def __signature__(self) -> inspect.Signature:  # torch's flex counts the parameters
        return inspect.signature(self._fn)

    def __call__(self, *args: Any) -> Tensor:
        return self._fn(*args)

    @property
    def recipe(self) -> Optional[Tuple[Any, Tuple[Tensor, ...]]]:
        """``(tree, tensors)``: how to build this mod again from its factory (plain dicts and
        lists naming the factory and its arguments, tensors by index), or None for a builtin
        that has no factory. Custom ops carry builtins this way (:func:`from_recipe`)."""
        return self._recipe

    def __reduce__(self) -> Any:
        if self._factory is None:
            return self.__name__  # a module-level builtin: found again by name
        return (self._factory, self._args)

    def __repr__(self) -> str:
        return f"<attnkit {self.__name__}>"


def _recipe_of(mod: Builtin) -> Optional[Tuple[Any, Tuple[Tensor, ...]]]:
    tensors: list = []
    try:
        tree = _encode(mod, tensors)
    except TypeError:
        return None
    return tree, tuple(tensors)


def _encode(x: Any, tensors: list) -> Any:
    if isinstance(x, Tensor):
        tensors.append(x)
        return {"t": len(tensors) - 1}
    if type(x) is Builtin:
        if x._factory is None:
            if x.__module__.startswith("attnkit.") and x.__name__.isidentifier():
                return {"name": f"{x.__module__}:{x.__name__}"}  # a module-level builtin
            raise TypeError(f"{x.__name__} has no factory")
        f = x._factory
        return {"f": f"{f.__module__}:{f.__name__}",  # (module-level factories)
                "a": [_encode(arg, tensors) for arg in x._args]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"v": x}
    if isinstance(x, (list, tuple)):
        return {"l": [_encode(item, tensors) for item in x]}
    raise TypeError(f"cannot describe a {type(x).__name__}")


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    if module != "attnkit" and not module.startswith("attnkit."):
        raise ValueError(f"a mod recipe may only name attnkit's own factories; got {path!r}")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def from_recipe(tree: Any, tensors: Sequence[Tensor]) -> Any:
    """The mod (or argument) a recipe describes, built with ``tensors`` (see
    :attr:`Builtin.recipe`); pass other tensors of the same shapes to rebuild it on them."""
    if isinstance(tree, str):  # (as JSON)
        tree = json.loads(tree)
    if "t" in tree:
        return tensors[tree["t"]]
    if "v" in tree:
        return tree["v"]
    if "l" in tree:
        return [from_recipe(item, tensors) for item in tree["l"]]
    if "name" in tree:
        return _resolve(tree["name"])
    return _resolve(tree["f"])(*[from_recipe(arg, tensors) for arg in tree["a"]])


def info_of(mod: Any) -> Optional[ModInfo]:
    """The description of a genuine builtin mod, else None (wrappers included)."""
    return mod._info if type(mod) is Builtin else None


def remap(mod: Callable[..., Tensor], index_map: IndexMap, *, score: bool, suffix: str,
          keep_structure: bool = False, factory: Optional[Callable[..., Any]] = None,
          args: Tuple[Any, ...] = ()) -> Callable[..., Tensor]:
    """``mod`` called with re-indexed ``(b, h, q_idx, kv_idx) = index_map(b, h, q, k)``.

    ``score`` says whether ``mod`` is a score_mod (a leading ``score`` argument) or a
    mask_mod. A builtin stays a builtin: its bias is re-indexed the same way and its cap kept;
    its structure is kept only with ``keep_structure`` (a map that leaves positions alone).
    ``factory(*args)`` rebuilds the result (for pickling and custom ops), where given."""
    name = f"{getattr(mod, '__name__', type(mod).__name__)}_{suffix}"
    if score:
        def fn(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return mod(s, *index_map(b, h, q_idx, kv_idx))
    else:
        def fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:  # type: ignore[misc]
            return mod(*index_map(b, h, q_idx, kv_idx))
    info = info_of(mod)
    if info is None:
        fn.__name__ = fn.__qualname__ = name
        return fn
    bias = info.bias
    if bias is not None:
        inner = bias

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return inner(*index_map(b, h, q_idx, kv_idx))

    structure = info.structure if keep_structure else {"kind": "remapped"}
    return Builtin(fn, name, ModInfo(structure=structure, bias=bias, cap=info.cap), factory,
                   args)


def _mod_name(mod: Any) -> str:
    return getattr(mod, "__name__", type(mod).__name__)


def _check_shape(kind: str, mod: Any, out: Tensor, tile: Tuple[int, ...]) -> None:
    ok = out.dim() == 0 or (out.dim() == len(tile)
                            and all(o in (1, t) for o, t in zip(out.shape, tile)))
    if not ok:
        raise ValueError(
            f"{kind} {_mod_name(mod)} returned a tensor of shape {tuple(out.shape)} for a tile "
            f"of {tile} (batch, heads, queries, keys); it must be computed elementwise from its "
            f"arguments, giving their broadcast shape (dims of size 1 allowed)")


def call_score_mod(mod: Callable[..., Tensor], score: Tensor, b: Tensor, h: Tensor,
                   q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mod(score, b, h, q_idx, kv_idx)`` checked (a float tensor of the tile's shape, or
    broadcast to it) and returned with ``score``'s shape and dtype."""
    out = mod(score, b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor):
        raise TypeError(f"score_mod {_mod_name(mod)} returned {type(out).__name__}; it must "
                        f"return the new scores, a float tensor shaped like `score`")
    if not out.dtype.is_floating_point:
        hint = (" (for a mask pass a mask_mod as mask=)" if out.dtype == torch.bool else "")
        raise TypeError(f"score_mod {_mod_name(mod)} returned a {out.dtype} tensor; it must "
                        f"return float scores{hint}")
    _check_shape("score_mod", mod, out, tuple(score.shape))
    if out.dtype != score.dtype:
        out = out.to(score.dtype)
    return out if out.shape == score.shape else out.expand(score.shape)


def call_mask_mod(mod: Callable[..., Tensor], b: Tensor, h: Tensor, q_idx: Tensor,
                  kv_idx: Tensor) -> Tensor:
    """``mod(b, h, q_idx, kv_idx)`` checked: a bool tensor that broadcasts to the tile
    ``(b, h, q_idx, kv_idx)`` spans (dims of size 1 allowed), returned as it is."""
    out = mod(b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = f"a {out.dtype} tensor" if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(f"mask_mod {_mod_name(mod)} returned {got}; it must return a bool "
                        f"tensor (True = may attend); for an additive float mask use bias= or "
                        f"a score_mod")
    tile = tuple(max(sizes) for sizes in zip(b.shape, h.shape, q_idx.shape, kv_idx.shape))
    _check_shape("mask_mod", mod, out, tile)
    return out


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
