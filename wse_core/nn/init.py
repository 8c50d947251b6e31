"""Model Zoo's parameter initializers: their names and keys (``INITIALIZERS``), checking a params
mapping into a resolved tuple, scaling one, and drawing values from one."""
from collections.abc import Mapping

import numpy as np

from wse_core.checks import show
from wse_core.errors import ConfigError, ConfigTypeError


#: Model Zoo's initializers by name, as ``model.initializer`` & co. spell them: their keys and defaults
#: (truncated_normal's a, b default to -2 std, +2 std, as Model Zoo's). A resolved initializer is a tuple
#: (name, *values in this order), the ``init`` of a ParamSpec.
INITIALIZERS = {"normal": {"mean": 0.0, "std": 0.05}, "truncated_normal": {"mean": 0.0, "std": 0.05, "a": None, "b": None},
                "uniform": {"a": -0.05, "b": 0.05}, "constant": {"val": 0.0}, "zeros": {}, "ones": {}}


def draw(init, shape, rng):
    """Values of a parameter initialised by ``init`` (a resolved tuple) from ``rng``, in float64.

    truncated_normal redraws the values outside [a, b] until none is (as torch's trunc_normal_ in
    distribution; not in bits, which depend on the generator)."""
    kind, *v = init
    if kind == "normal":
        return rng.normal(v[0], v[1], shape)
    if kind == "truncated_normal":
        mean, std, a, b = v
        x = rng.normal(mean, std, shape)
        bad = (x < a) | (x > b)
        while bad.any():
            x[bad] = rng.normal(mean, std, int(bad.sum()))
            bad = (x < a) | (x > b)
        return x
    if kind == "uniform":
        return rng.uniform(v[0], v[1], shape)
    return np.full(shape, {"zeros": 0.0, "ones": 1.0}.get(kind, v[0] if v else 0.0))


def resolve_initializer(value, key):
    """A ``model.*initializer`` mapping (``{name: truncated_normal, std: 0.02}``) as a resolved tuple."""
    if not isinstance(value, Mapping):
        raise ConfigTypeError(f"{key}: expected a mapping with a name (one of {', '.join(INITIALIZERS)}), "
                              f"got {show(value)}")
    name = value.get("name")
    if name not in INITIALIZERS:
        raise ConfigError(f"{key}.name: expected one of {', '.join(INITIALIZERS)}, got {show(name)}")
    args = dict(INITIALIZERS[name])
    for k, v in value.items():
        if k == "name":
            continue
        if k not in args:
            raise ConfigError(f"{key}.{k}: not a key of {name} (keys: {', '.join(args) or 'none'})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise ConfigError(f"{key}.{k}: expected a number, got {show(v)}")
        args[k] = float(v)
    if name in ("normal", "truncated_normal") and not args["std"] > 0:
        raise ConfigError(f"{key}.std: expected a number > 0, got {show(args['std'])}")
    if name == "truncated_normal":
        args["a"] = -2 * args["std"] if args["a"] is None else args["a"]
        args["b"] = 2 * args["std"] if args["b"] is None else args["b"]
        if not args["a"] < args["mean"] < args["b"]:
            raise ConfigError(f"{key}: expected a < mean < b, got a={args['a']:g}, mean={args['mean']:g}, "
                              f"b={args['b']:g}")
    if name == "uniform" and not args["a"] < args["b"]:
        raise ConfigError(f"{key}: expected a < b, got a={args['a']:g}, b={args['b']:g}")
    return (name, *args.values())


def scaled(init, factor):
    """``init`` with its spread (std and bounds) multiplied by ``factor`` (Model Zoo's depth scaling)."""
    kind, *v = init
    if kind == "normal":
        return (kind, v[0], v[1] * factor)
    if kind == "truncated_normal":
        return (kind, v[0], v[1] * factor, v[2] * factor, v[3] * factor)
    return init
