"""Integrations of attnkit with other libraries.

Each integration lives in its own submodule and imports its library only when that submodule is
imported, so ``import attnkit`` never needs them:

- :mod:`attnkit.integrations.transformers`: ``attn_implementation="attnkit"`` for Hugging Face
  transformers (``pip install 'attnkit[transformers]'``).
"""

__all__: list = []
