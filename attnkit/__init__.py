"""attnkit: scaled dot-product attention with every mask and score variant, exact hand-written
gradients, fast on the machine you have.

The one entry point is :func:`attention`; :func:`attention_reference` is the dense float64 oracle
it is tested against. Masks and score mods live in :mod:`attnkit.masks` and
:mod:`attnkit.score_mods`.

The package, by what it holds: :mod:`attnkit.doors` (the front doors), :mod:`attnkit.terms`
(the spec and its mask and score terms), :mod:`attnkit.kv` (paged caches, merging partial
states), :mod:`attnkit.engine` (plan, the autograd node, the custom ops),
:mod:`attnkit.backends` (the executors), :mod:`attnkit.native` (the C kernels),
:mod:`attnkit.integrations` (transformers, torch's varlen registry), :mod:`attnkit.bench`
(the benchmark, with the ``bench`` extra); :mod:`attnkit.reference` and :mod:`attnkit.numpy`
state the math plainly. The flat module paths of 0.1 (``attnkit.api``, ``attnkit.spec``, ...)
still import: :mod:`attnkit._moved`.
"""

import sys

__version__ = "0.2.0"  # first: the ops' revision (attnkit.ops.OP_REVISION) starts with it

# isort: off
# (first, before anything imports torch's compiler: under ATEN_CPU_CAPABILITY, torch's compile
# cache gets a folder of its own; torch's cache does not key on the capability)
from .engine import compile_cache as _compile_cache  # noqa: F401
# isort: on
from . import _moved, numpy
from .doors import ring as distributed
from .doors.attention import (
    AuxOutput,
    AuxRequest,
    GradAmax,
    Grads,
    attention,
    attention_backward,
    attention_forward,
    scaled_dot_product_attention,
)
from .doors.errors import AttentionTypeError, AttentionValueError
from .doors.flex import flex_attention
from .doors.paged import paged_attention, paged_attention_blocks
from .doors.varlen import varlen_attention
from .integrations import torch_varlen as _torch_varlen
from .kv.merge import merge_state, merge_states
from .kv.paged import OutOfPagesError, PagedKVCache, gather_kv
from .reference import attention_reference
from .terms import masks, score_mods
from .terms.block_mask import BlockMask, create_block_mask
from .terms.fp8 import quantize_fp8

_moved.install(sys.modules[__name__])  # attnkit.api, attnkit.spec, ...: the 0.1 paths
_torch_varlen.register()  # "attnkit" in torch's flash-attention registry (not activated)

__all__ = [
    "AttentionTypeError",
    "AttentionValueError",
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "GradAmax",
    "Grads",
    "OutOfPagesError",
    "PagedKVCache",
    "attention_backward",
    "attention_forward",
    "create_block_mask",
    "distributed",
    "flex_attention",
    "paged_attention",
    "paged_attention_blocks",
    "varlen_attention",
    "scaled_dot_product_attention",
    "__version__",
    "attention",
    "attention_reference",
    "gather_kv",
    "masks",
    "merge_state",
    "merge_states",
    "numpy",
    "quantize_fp8",
    "score_mods",
]
