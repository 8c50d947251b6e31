"""The exceptions of data_tools: each message is one line naming the file, dataset and example at fault.

``DataError`` is the project's data kind (``wse_core.errors``), re-exported so ``data_tools.errors.
DataError`` stays the name callers know; one class, so either name catches what the other raises.
"""
from wse_core.errors import DataError

__all__ = ["CheckpointError", "DataError", "DataWarning"]


class CheckpointError(DataError):
    """A checkpoint is missing, incomplete or damaged (a DataError, so a ValueError, as before)."""


class DataWarning(UserWarning):
    """Something was written without a part that could not be made (one line: which part, and why)."""
