"""Exceptions raised by the partitioners package."""


class TraceError(RuntimeError):
    """The model cannot be turned into a cost graph (names the failing code and the fix)."""


class PartitionError(ValueError):
    """A partition request that cannot be satisfied (names the cause and the fix)."""
