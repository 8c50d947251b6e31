"""The appliance's requests: one dataclass per operation, its fields checked on arrival.

A request is one line of JSON, ``{"op": NAME, field: value, ...}`` (docs/design/appliance.md "Requests").
``parse`` reads the line and returns the operation's dataclass or raises ``RequestError`` with the
one line the caller sees: an unknown field, a required one missing, a mistyped one (an int is not a
bool, a bool is not an int), a value out of range, a path that is not absolute and printable. What
depends on the service (who asks, whether it is stopping, which jobs exist) is checked by the
service's handler (``service.py``).
"""
import dataclasses
import json
import os
from typing import ClassVar

from pyapi.errors import RequestError
from wse_core.checks import Int
from wse_core.numerics import ENV_NAMES, ENV_PREFIXES, is_numerics_variable

#: Longest path accepted for a job's directory or model_dir.
MAX_PATH = 4096
#: A submission's numerics variables (wse_core.numerics): how many, and how long a value may be.
MAX_NUMERICS = 64
MAX_NUMERICS_VALUE = 1024


def printable(text, limit=None):
    """``text`` without control characters (a user's line shown on root's terminal carries no escapes)."""
    out = "".join(c if c.isprintable() else " " for c in text)
    return out if limit is None else out[:limit]


def check_path(value, what):
    if not os.path.isabs(value) or len(value) > MAX_PATH or not value.isprintable():
        raise RequestError(f"{what}: expected an absolute path of printable characters, got {value[:100]!r}")
    return os.path.normpath(value)


def check_numerics(variables):
    """A submission's ``numerics`` field: variables that steer numerics (``wse_core.numerics``) and nothing
    else of the submitter's environment (LD_PRELOAD, PATH, PYTHONPATH... would reach what the runner
    loads), with names of identifier characters and printable values of bounded length."""
    if len(variables) > MAX_NUMERICS:
        raise RequestError(f"numerics: at most {MAX_NUMERICS} variables, got {len(variables)}")
    for name, value in variables.items():
        if not (name.isascii() and name.isidentifier() and is_numerics_variable(name)):
            kinds = ", ".join([*(f"{p}*" for p in ENV_PREFIXES), *ENV_NAMES])
            raise RequestError(f"numerics: {printable(name, 40)!r} is not a numerics variable ({kinds})")
        if not isinstance(value, str) or len(value) > MAX_NUMERICS_VALUE or not value.isprintable():
            raise RequestError(f"numerics.{name}: expected printable text of at most {MAX_NUMERICS_VALUE} "
                               f"characters, got {printable(repr(value), 40)}")
    return variables


def _field(kind, default=dataclasses.MISSING):
    """A request field of JSON type ``kind`` (a type or a tuple of types); without a default, required."""
    return dataclasses.field(default=default, metadata={"kind": kind})


class Request:
    """A request's fields, typed as its dataclass declares them; ``check`` adds the checks of values."""

    @classmethod
    def from_fields(cls, req):
        """``req`` (the request's object without "op") checked field by field, in declaration order."""
        spec = dataclasses.fields(cls)
        unknown = set(req) - {f.name for f in spec}
        if unknown:
            raise RequestError(f"unknown field {printable(sorted(unknown)[0], 40)!r}")
        out = {}
        for f in spec:
            kind = f.metadata["kind"]
            if f.name not in req and f.default is dataclasses.MISSING:
                raise RequestError(f"{f.name}: required")
            value = req.get(f.name, f.default)
            # A JSON null is taken as given, as the service always has (the checks below meet it).
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
                kinds = kind if isinstance(kind, tuple) else (kind,)
                raise RequestError(f"{f.name}: expected {' or '.join(k.__name__ for k in kinds)}, "
                                   f"got {type(value).__name__}")
            out[f.name] = value
        request = cls(**out)
        request.check()
        return request

    def check(self):
        """Checks of the values (ranges, paths), after their types."""


@dataclasses.dataclass
class Status(Request):
    """The pool, its free CS-2s and its queue."""


#: The kinds of job the appliance runs: "train" (``wse fit --submit``: params as ``pyapi.params``
#: checks them) and "serve" (``wse serve --submit``: a ``ServeSpec``).
JOB_KINDS = ("train", "serve")


@dataclasses.dataclass
class Submit(Request):
    """Queue a job: its kind and params, the submitter's directory and numerics variables; checked then
    as the caller."""
    params: dict = _field(dict)
    cwd: str = _field(str)
    kind: str = _field(str, "train")         # one of JOB_KINDS
    max_restarts: int = _field(int, 0)       # 0..100
    priority: int = _field(int, 0)           # -1000..1000; above 0 only for root (or the service's owner)
    name: str = _field(str, "job")           # printable, at most 64 characters
    numerics: dict = _field(dict, None)      # None: a client of an earlier version, which sent none

    def check(self):
        try:  # the one validator's ranges (wse_core.checks); the JSON types are checked above
            Int(0, 100)(self.max_restarts, "max_restarts")
            Int(-1000, 1000)(self.priority, "priority")
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if self.kind not in JOB_KINDS:
            raise RequestError(f"kind: expected one of {', '.join(JOB_KINDS)}, got {printable(self.kind, 40)!r}")
        self.name = printable(self.name, 64).strip() or "job"
        self.cwd = check_path(self.cwd, "cwd")
        if self.numerics is not None:
            check_numerics(self.numerics)


@dataclasses.dataclass
class ServeSpec(Request):
    """A serve job's params (``wse serve --submit``): ``pyapi.serve.Server`` on an inference job of
    ``num_csx`` CS-2s, serving ``host``:``port`` until cancelled. The checker then loads the model
    and plans its job as the submitter (``checker.check_serve``)."""
    kind: ClassVar[str] = "serve"
    model: str = _field(str)
    num_csx: int = _field(int)
    host: str = _field(str)
    port: int = _field(int)
    checkpoint_path: str = _field(str, None)
    placement: str = _field(str, None)
    max_streams: int = _field(int, None)
    max_tokens: int = _field(int, None)
    max_prompt_tokens: int = _field(int, None)
    peer_timeout: int = _field(int, None)
    log_dir: str = _field(str, None)

    def check(self):
        self.model = check_path(self.model, "model")
        if self.log_dir is not None:
            self.log_dir = check_path(self.log_dir, "log_dir")
        if not 0 <= self.port < 65536:
            raise RequestError(f"--port: expected a port in [0, 65535], got {self.port}")

    def to_dict(self):
        """The fields that are set, as the job's params in the store."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass
class Jobs(Request):
    """The caller's jobs (root: everyone's)."""


@dataclasses.dataclass
class Job(Request):
    """One job's record."""
    id: int = _field(int)


@dataclasses.dataclass
class Cancel(Request):
    """End a queued job at once, or stop a running one's ranks."""
    id: int = _field(int)


@dataclasses.dataclass
class Logs(Request):
    """A job's log as it stands, or as it grows until the job ends (``follow``)."""
    id: int = _field(int)
    follow: bool = _field(bool, False)


@dataclasses.dataclass
class Wait(Request):
    """The job's record once it has ended, or a refusal after ``timeout`` seconds."""
    id: int = _field(int)
    timeout: float = _field((int, float), None)


@dataclasses.dataclass
class Stop(Request):
    """Stop the service: running jobs are interrupted and stay queued for its next start."""


#: Each operation's request, by the name the wire carries in "op".
OPS = {"status": Status, "submit": Submit, "jobs": Jobs, "job": Job, "cancel": Cancel, "logs": Logs,
       "wait": Wait, "stop": Stop}


def parse(line):
    """One request line (bytes) as its dataclass; RequestError with the caller's one line otherwise."""
    try:
        req = json.loads(line)
    except (ValueError, RecursionError):
        raise RequestError("a request is one line of JSON") from None
    if not isinstance(req, dict):
        raise RequestError("a request is a JSON object")
    op = req.pop("op", None)
    cls = OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise RequestError(f"unknown request {printable(str(op), 40)!r}")
    return cls.from_fields(req)
