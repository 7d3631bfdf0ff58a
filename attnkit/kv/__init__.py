"""Key/value storage beyond one contiguous tensor.

:mod:`.paged` (``PagedKVCache`` and the paged front doors), :mod:`.pages` (the block-table
layout: validation and the gather) and :mod:`.merge` (merging partial attention states by their
log-sum-exp: split-KV, cascade and ring attention).
"""
