"""The project's one error root, ``WseError``, and its four kinds, each also the builtin it is.

On the bottom floor so every package can raise a kind. A kind subclasses the builtin it replaces
(a ConfigError is a ValueError, a JobError a RuntimeError), so a caller or test written against the
builtin still catches it; the command line catches the root (and OSError) and prints its one line,
while a plain ValueError or TypeError, which a bug raises, keeps its traceback. After Python's own
practice (``requests.RequestException``, h5py's OSError subclasses).

Which kind: the one a user acts on. A key or option to change is a ConfigError; a file to
rewrite or fetch again a DataError; a model, batch or machine count to change because the run does
not fit a PlanError; a job, rank or launch that failed, whose log says more, a JobError. A value of
the wrong type in a user's params is a ConfigTypeError: a ConfigError that is also the TypeError the
validators raised for it before, so neither ``except ValueError`` nor ``except TypeError`` loses it.
"""


class WseError(Exception):
    """A failure a user can act on, said in one line (what `wse CMD: error: ...` prints). Catch a kind
    rather than this when only some failures are yours to handle."""


class ConfigError(WseError, ValueError):
    """Params, options or arguments a user gave that are refused; the message names the key or option."""


class ConfigTypeError(ConfigError, TypeError):
    """A ConfigError for a value of the wrong type (``model.num_heads: expected an integer, got 'x'``):
    still the TypeError the validators raised before the root existed, so ``except TypeError`` holds."""


class DataError(WseError, ValueError):
    """A dataset or checkpoint (a file, a directory, an example) missing, unreadable or malformed; the
    message names the file and, where there is one, the dataset and the example."""


class PlanError(WseError, ValueError):
    """A run that cannot be laid out on the machines it asks for (a model that does not fit a wafer, a
    batch that does not divide); the message names what to change."""


class JobError(WseError, RuntimeError):
    """A job, rank or launch that failed; the message names the rank, its role and what happened."""
