"""The one-line errors of the front-end: the refusal of what the emulator does not build, and a
cluster's job that failed."""
from pyapi.errors import JobError as _JobError
from wse_core.compiler import CompileError


class JobError(_JobError):
    """The cluster's job behind a loop failed. The message is the one line `wse fit` gives for the same
    failure (the rank, its role, what happened), and ``python -m pyapi.cstorch`` prints it as that
    line; ``log`` is the job's output. A RuntimeError, as the front-end raised before it had a type
    (Cerebras' client raises its own ApplianceClientException kinds, of its appliance package)."""

    def __init__(self, line, log):
        super().__init__(line)
        self.log = log


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
