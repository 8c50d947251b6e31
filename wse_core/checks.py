"""The one validator: what a value may be (``Int``, ``Number``, ``OneOf``, ...), the fields of a spec
(``key``) and ``check_fields``, which walks a spec's dataclass over a mapping; and the checks of the
arrays the kernels' Python wrappers take (the kernels trust their inputs).

Every params section (``mpi_launch.spec``), every model family's config (``wse_core.nn.config``),
every scheduler (``wse_core.optim.schedules``), the optimizers' arguments and the appliance's requests
are checked by these constraints, so one kind of value is described one way everywhere: a failure
is a ``ConfigError`` (``wse_core.errors``: a ``ValueError``, of the right type and out of range) or a
``ConfigTypeError`` (also a ``TypeError``: a value of the wrong type) whose one line starts with the
key path: ``model.num_heads: expected an integer >= 1, got 0``. The array checks below are for
programs calling the kernels, not for a user's values: their TypeError and ValueError are a bug's.
"""
import math
import reprlib
from dataclasses import MISSING, field, fields

import numpy as np

from wse_core.errors import ConfigError, ConfigTypeError

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = _REPR.maxset = 6
_REPR.maxlevel = 3


def show(value):
    """A value for an error message: its repr, bounded in length and in the work it takes (a value
    from a user's YAML can be huge)."""
    return _REPR.repr(value)


def plural(n, noun, nouns=None):
    """A count and its noun for a message, agreeing: ``1 shard``, ``24 shards``, ``2 micro-batches``
    (``nouns``: the plural where adding s or es would not make it)."""
    if n == 1:
        return f"1 {noun}"
    return f"{n:,} {nouns or noun + ('es' if noun.endswith(('s', 'sh', 'ch', 'x')) else 's')}"


def did_you_mean(name, known):
    """What an error about an unknown ``name`` says of the ``known`` ones: the closest when one is
    close (a typo: ``did you mean hidden_size?``), else all of them (``known: a, b, c``)."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1)
    return f"did you mean {close[0]}?" if close else f"known: {', '.join(map(str, known))}"


def check_float_array(name, x, *, writeable=False):
    """Return ``x`` flattened to a 1-D view after checking type, dtype and contiguity."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32 or float64, got {x.dtype}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (use np.ascontiguousarray)")
    if writeable and not x.flags.writeable:
        raise ValueError(f"{name}: array is read-only but is updated in place")
    return x.reshape(-1)


def check_like(name, x, ref_name, ref, *, writeable=False):
    """Check ``x`` has the dtype and shape of ``ref`` and return it flattened."""
    flat = check_float_array(name, x, writeable=writeable)
    if x.dtype != ref.dtype:
        raise TypeError(f"{name}: expected {ref.dtype} like {ref_name}, got {x.dtype}")
    if x.shape != ref.shape:
        raise ValueError(f"{name}: expected shape {ref.shape} like {ref_name}, got {x.shape}")
    return flat


# -- constraints -----------------------------------------------------------------------------------

class Constraint:
    """What a value may be. ``check(value, path)`` returns the value normalised (an integer as ``int``,
    a number as ``float``) or raises naming ``path``; ``expected`` says it in words, for messages and
    the help. ``none=True`` also accepts null (``expected`` then ends in "(or null)")."""

    expected = "a value"

    def __init__(self, *, none=False):
        self.none = none

    def __call__(self, value, path):
        if value is None and self.none:
            return None
        return self.check(value, path)

    def describe(self):
        return self.expected + (" (or null)" if self.none else "")

    def fail(self, value, path, error=ConfigError):
        return error(f"{path}: expected {self.describe()}, got {show(value)}")


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


class Int(Constraint):
    """An integer (not a bool) in [low, high]. With ``bound``, ``high`` is a limit of wse-cluster's, not
    of the value's meaning: a size no real run reaches, refused at once where it would take minutes or
    all memory to fail; ``bound`` names it for the message (``wse-cluster's bound on layers (...)``)."""

    def __init__(self, low=1, high=None, *, bound=None, none=False):
        super().__init__(none=none)
        self.low, self.high, self.bound = low, high, bound
        self.expected = f"an integer >= {low}" if high is None or bound else f"an integer in [{low}, {high}]"

    def check(self, value, path):
        if not _is_int(value):
            raise ConfigTypeError(f"{path}: expected an integer, got {show(value)}")
        if self.bound and value > self.high:
            raise ConfigError(f"{path}: {show(value)} is more than {self.high:,}, {self.bound}")
        if value < self.low or self.high is not None and value > self.high:
            raise self.fail(value, path)
        return int(value)


class Number(Constraint):
    """A finite number (not a bool) between ``low`` and ``high``, each bound closed unless ``open``
    names it: ``Number(0, open="low")`` is > 0, ``Number(0, 1, open="high")`` is in [0, 1)."""

    def __init__(self, low=None, high=None, *, open="", none=False):
        super().__init__(none=none)
        self.low, self.high = low, high
        self.low_open, self.high_open = "low" in open, "high" in open
        lo = None if low is None else f"{low:g}"
        hi = None if high is None else f"{high:g}"
        if lo is not None and hi is not None:
            self.expected = f"a number in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        elif lo is not None:
            self.expected = f"a number {'>' if self.low_open else '>='} {lo}"
        elif hi is not None:
            self.expected = f"a number {'<' if self.high_open else '<='} {hi}"
        else:
            self.expected = "a finite number"

    def check(self, value, path):
        if not _is_number(value):
            raise ConfigTypeError(f"{path}: expected a number, got {show(value)}")
        v = float(value)
        if not math.isfinite(v) or (self.low is not None and (v <= self.low if self.low_open else v < self.low)) \
                or (self.high is not None and (v >= self.high if self.high_open else v > self.high)):
            raise self.fail(value, path)
        return v


class Bool(Constraint):
    expected = "true or false"

    def check(self, value, path):
        if not isinstance(value, bool):
            raise self.fail(value, path, ConfigTypeError)
        return value


class Text(Constraint):
    expected = "a non-empty string"

    def check(self, value, path):
        if not isinstance(value, str) or not value:
            raise self.fail(value, path)
        return value


class OneOf(Constraint):
    """One of ``options`` (compared by value and type: ``True`` is not ``1``). With ``noun``, a value
    outside them is "unknown <noun> X (known: ...)", as for a name."""

    def __init__(self, *options, noun=None, none=False):
        super().__init__(none=none)
        self.options, self.noun = options, noun
        names = [o if isinstance(o, str) else show(o) for o in options]
        self.expected = " or ".join(names) if len(names) <= 2 else f"one of {', '.join(names)}"

    def check(self, value, path):
        if any(value == o and type(value) is type(o) for o in self.options):
            return value
        if self.noun:
            raise ConfigError(f"{path}: unknown {self.noun} {show(value)} ({did_you_mean(value, self.options)})")
        raise self.fail(value, path)


class Fixed(Constraint):
    """The one value something is built with: ``Fixed("rmsnorm", "llama")``."""

    def __init__(self, value, who):
        super().__init__()
        self.value, self.who = value, who
        self.expected = show(value)

    def check(self, value, path):
        if value != self.value or type(value) is not type(self.value):
            raise ConfigError(f"{path}: {self.who} is built with {show(self.value)}, got {show(value)}")
        return value


class ListOf(Constraint):
    """A list (or tuple) whose items each meet ``item``; returned as a list."""

    def __init__(self, item, *, length=None, empty=True, expected=None, none=False):
        super().__init__(none=none)
        self.item, self.length, self.empty = item, length, empty
        self.expected = expected or (f"{length} of {item.describe()}" if length else f"a list of {item.describe()}")

    def check(self, value, path):
        if not isinstance(value, (list, tuple)) or self.length is not None and len(value) != self.length \
                or not value and not self.empty:
            raise self.fail(value, path, ConfigTypeError if not isinstance(value, (list, tuple)) else ConfigError)
        return [self.item(v, f"{path}[{i}]") for i, v in enumerate(value)]


class Check(Constraint):
    """A value checked by ``fn(value, path)``, which returns it normalised or raises naming ``path``:
    for values with a grammar of their own (a scheduler, an initializer, a data mixture)."""

    def __init__(self, fn, expected, *, none=False):
        super().__init__(none=none)
        self.fn, self.expected = fn, expected

    def check(self, value, path):
        return self.fn(value, path)


# -- specs: dataclasses whose fields carry their constraint ----------------------------------------

def key(check, help, default=MISSING, factory=MISSING, **meta):
    """A spec's field: ``check`` (a Constraint) is what its value must be; ``meta`` holds more that
    readers of the spec want (``zoo``: the key's Model Zoo fate; ``aliases``: older names)."""
    return field(default=default, default_factory=factory, metadata={"check": check, "help": help, **meta})


def default_of(f):
    """A field's default (a fresh one for a factory), or MISSING for a required one."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def check_fields(cls, given, path, problems=None):
    """The values of ``cls``'s fields (a spec dataclass whose fields were made by ``key``) read from
    the mapping ``given``: each checked by its constraint, absent ones (and nulls where the default is
    null) set to their default. An unknown key, a missing required one or a bad value raises its one
    line; with a ``problems`` list, each is appended there instead and the walk goes on."""
    known = {f.name: f for f in fields(cls)}
    out = {}

    def problem(exc):
        if problems is None:
            raise exc
        problems.append(str(exc))

    for name in given:
        if name not in known:
            problem(ConfigError(f"{path}.{_short(name)}: unknown key ({did_you_mean(name, sorted(known))})"))
    for name, f in known.items():
        default = default_of(f)
        value = given.get(name, MISSING)
        try:
            if value is MISSING or value is None and default is None:
                if default is MISSING:
                    raise ConfigError(f"{path}.{name}: missing ({f.metadata['help']})")
                out[name] = default
            else:
                out[name] = f.metadata["check"](value, f"{path}.{name}")
        except (TypeError, ValueError) as exc:
            problem(exc)
    return out


def _short(name):
    """A key for a message: as written, unless it is long or not a string."""
    return name if isinstance(name, str) and len(name) <= 60 else show(name)


# -- Model Zoo's keys a spec has no field for -------------------------------------------------------

class Zoo:
    """The fate of a Model Zoo key a spec has no field for (docs/design/params.md "Every key has
    a fate"); a spec lists them in its ``ZOO`` mapping, beside its fields (whose fate is "honoured")."""

    def __init__(self, fate, accepted=(), meaning=""):
        self.fate, self.accepted, self.meaning = fate, accepted, meaning

    @classmethod
    def tuning(cls):
        """Tunes a real system's hardware, input pipeline or logging: accepted, dropped, warned about."""
        return cls("tuning")

    @classmethod
    def same(cls, accepted, asks, refusal=None):
        """Names what is always done here: honoured with one of ``accepted``; another value ``asks`` for
        what is not built (or is refused with ``refusal``, when given)."""
        return cls("same", tuple(accepted), refusal or f"{{value}} asks for {asks}, which is not built")

    @classmethod
    def not_built(cls, what):
        """Would change the numerics and is not built: refused whatever its value."""
        return cls("not built", (), f"{what} is not built")

    def judge(self, value):
        """This key's fate with ``value``: "tuning", "honoured (same value)" or "refused: why"."""
        if self.fate == "tuning":
            return "tuning"
        if self.fate == "same" and any(value == a and type(value) is type(a) or isinstance(a, float) and _is_int(value)
                                       and value == a for a in self.accepted):
            return "honoured (same value)"
        return "refused: " + self.meaning.replace("{value}", show(value))
