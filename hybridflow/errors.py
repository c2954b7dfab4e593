"""The one error class shared by every layer for input a function refuses.

verl checks its inputs with ``assert``, so code written against verl catches ``AssertionError``;
Python code in general catches ``ValueError``. :class:`InvalidInputError` is both, so callers of
either kind keep working. (Unlike a bare ``assert`` it is raised under ``python -O`` too.)
"""


class InvalidInputError(ValueError, AssertionError):
    """Bad input: a ``ValueError``, and an ``AssertionError`` where verl would assert."""


class DataProtoError(InvalidInputError):
    """A DataProto operation refused its input (re-exported by :mod:`hybridflow.protocol`)."""
