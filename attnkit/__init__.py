"""attnkit: scaled dot-product attention with every mask and score variant, exact hand-written
gradients, fast on the machine you have.

The one entry point is :func:`attention`; :func:`attention_reference` is the dense float64 oracle
it is tested against. Masks and score mods live in :mod:`attnkit.masks` and
:mod:`attnkit.score_mods`.
"""

from . import masks, score_mods
from .api import attention
from .merge import merge_state, merge_states
from .paged import PagedKVCache, gather_kv
from .reference import attention_reference

__version__ = "0.1.0"

__all__ = [
    "PagedKVCache",
    "__version__",
    "attention",
    "attention_reference",
    "gather_kv",
    "masks",
    "merge_state",
    "merge_states",
    "score_mods",
]
