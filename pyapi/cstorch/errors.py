"""The one-line refusal of what the emulator does not build."""
from wse_core.compiler import CompileError


class NotBuilt(CompileError, NotImplementedError):
    """A part of Cerebras' API this emulator does not build (the message names it and what is built).
    A CompileError, so one raised while the step is captured reaches the user as it was said."""


def not_built(what, instead):
    return NotBuilt(f"{what}: not built in wse-cluster ({instead})")


class NotBuiltAttribute(NotBuilt, AttributeError):
    """A name of Cerebras' API not built here: one line, and an AttributeError, so ``hasattr`` and
    ``getattr(module, name, default)`` answer as for any missing name."""


def refusing(module, built):
    """A module's ``__getattr__``: its other public names refused in one line naming them and what
    ``module`` builds."""

    def __getattr__(name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise NotBuiltAttribute(f"{module}.{name}: not built in wse-cluster ({built})")

    return __getattr__
