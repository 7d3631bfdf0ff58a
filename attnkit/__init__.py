"""attnkit: scaled dot-product attention with every mask and score variant, exact hand-written
gradients, fast on the machine you have.

The one entry point is :func:`attention`; :func:`attention_reference` is the dense float64 oracle
it is tested against. Masks and score mods live in :mod:`attnkit.masks` and
:mod:`attnkit.score_mods`.
"""

__version__ = "0.2.0"  # first: the ops' revision (attnkit.ops.OP_REVISION) starts with it

from . import distributed, masks, numpy, score_mods
from .api import (
    AuxOutput,
    AuxRequest,
    GradAmax,
    Grads,
    attention,
    attention_backward,
    attention_forward,
    scaled_dot_product_attention,
)
from .block_mask import BlockMask, create_block_mask
from .errors import AttentionTypeError, AttentionValueError
from .flex import flex_attention
from .fp8 import quantize_fp8
from .integrations import torch_varlen as _torch_varlen
from .merge import merge_state, merge_states
from .paged import (
    OutOfPagesError,
    PagedKVCache,
    gather_kv,
    paged_attention,
    paged_attention_blocks,
)
from .reference import attention_reference
from .varlen import varlen_attention

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
