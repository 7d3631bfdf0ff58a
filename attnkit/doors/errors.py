"""Error classes of the torch drop-in front doors.

torch's ``scaled_dot_product_attention`` (and, for some inputs, ``flex_attention``) raises
``RuntimeError`` where attnkit raises ``TypeError`` or ``ValueError``, so code written against
torch (``except RuntimeError``) would not catch attnkit's errors. The drop-in doors
(:func:`attnkit.scaled_dot_product_attention`, :func:`attnkit.flex_attention`) raise these
classes instead: each is both attnkit's class and ``RuntimeError``, with the same message, so
``except TypeError``, ``except ValueError`` and ``except RuntimeError`` all catch them.
"""

from __future__ import annotations

from typing import Optional


class AttentionTypeError(TypeError, RuntimeError):
    """A wrong type or dtype given to a torch drop-in door: a ``TypeError`` that torch-written
    code also catches as ``RuntimeError`` (torch's class for the same input)."""


class AttentionValueError(ValueError, RuntimeError):
    """A wrong value or shape given to a torch drop-in door: a ``ValueError`` that
    torch-written code also catches as ``RuntimeError`` (torch's class for the same input)."""


def torch_compatible(err: BaseException) -> Optional[BaseException]:
    """``err`` as the drop-in doors raise it: a plain ``TypeError``/``ValueError`` becomes
    :class:`AttentionTypeError`/:class:`AttentionValueError` with the same arguments and
    traceback; None for anything else (subclasses with a meaning of their own, such as
    :class:`attnkit.OutOfPagesError`, and errors that are already both, pass unchanged).
    Use as ``raise converted from None`` inside ``except``."""
    kind = {TypeError: AttentionTypeError, ValueError: AttentionValueError}.get(type(err))
    if kind is None:
        return None
    return kind(*err.args).with_traceback(err.__traceback__)
