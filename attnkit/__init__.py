"""attnkit: scaled dot-product attention with every mask and score variant, exact hand-written
gradients, fast on the machine you have."""

from .api import attention
from .reference import attention_reference

__version__ = "0.1.0"

__all__ = ["attention", "attention_reference", "__version__"]
