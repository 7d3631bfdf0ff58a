"""Key/value storage beyond one contiguous tensor.

:mod:`.paged` (``PagedKVCache`` and the spec of a call over its pages; the front doors over
it are :mod:`attnkit.doors.paged`), :mod:`.pages` (the block-table
layout: validation and the gather) and :mod:`.merge` (merging partial attention states by their
log-sum-exp: split-KV, cascade and ring attention).
"""
