"""The spec and its terms: what one attention call means, validated and normalised.

:mod:`.spec` (``Options``, ``build_spec``, the frozen ``AttentionSpec``), :mod:`.checks`
(argument checks shared by the doors), the mask and score terms (:mod:`.masks`,
:mod:`.score_mods`, :mod:`.mods`: what attnkit knows about builtins, :mod:`.block_mask`,
:mod:`.score_terms`: the terms applied to a score tile, written once), :mod:`.dropout`
(counter-based replayable dropout) and :mod:`.fp8` (fp8 inputs and their scales).
"""
