"""Argument checks shared by the Python wrappers of every kernel (the kernels trust their inputs)."""
import reprlib

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = _REPR.maxset = 6
_REPR.maxlevel = 3


def show(value):
    """A value for an error message: its repr, bounded in length and in the work it takes (a value
    from a user's YAML can be huge)."""
    return _REPR.repr(value)


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


def check_number(name, value, *, low=None, high=None, high_open=False):
    """Return ``value`` as a float after checking it is a finite number within [low, high] (or [low, high))."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a number, got {show(value)}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name}: expected >= {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name}: expected {'<' if high_open else '<='} {high}, got {value}")
    return value
