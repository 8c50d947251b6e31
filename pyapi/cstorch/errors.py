"""The one-line refusal of what the emulator does not build."""
from wse_core.compiler import CompileError


class NotBuilt(CompileError, NotImplementedError):
    """A part of Cerebras' API this emulator does not build (the message names it and what is built).
    A CompileError, so one raised while the step is captured reaches the user as it was said."""


def not_built(what, instead):
    return NotBuilt(f"{what}: not built in wse-cluster ({instead})")
