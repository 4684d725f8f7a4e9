"""The error a checkpoint that cannot be saved or loaded raises."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; the message names the file and the fix."""
