"""The front doors: every way a call comes in, each turning its arguments into one
:class:`~attnkit.terms.spec.AttentionSpec`.

:mod:`.attention` (``attention``, ``scaled_dot_product_attention``, the forward/backward pair
and the replay of recurring calls), :mod:`.flex` (``flex_attention``), :mod:`.varlen` and
:mod:`.varlen_pages` (packed sequences, over contiguous or paged K/V), :mod:`.paged`
(``paged_attention`` and ``paged_attention_blocks``: over a paged cache), :mod:`.ring` (ring
attention over ``torch.distributed``), :mod:`.compiled` (the doors as ``torch.compile`` traces
them) and :mod:`.errors` (the drop-in doors' torch-compatible error classes).
"""
