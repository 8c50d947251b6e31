"""The checks of the params' ``model`` section that every family shares: keys, integers, numbers,
rates, sparsity, precision and loss scaling. Each raises a ValueError/TypeError naming the key
(``model.num_heads: ...``) and writes the value it accepts into the resolved config ``c``."""
import numpy as np

from wse_core._checks import did_you_mean, show
from wse_core.nn.precision import FORMATS


def check_keys(cfg, known):
    for key in cfg:
        if key not in known:
            raise ValueError(f"model.{key}: unknown key ({did_you_mean(key, sorted(known))})")


def check_int(cfg, key, low=1):
    v = cfg.get(key)
    if v is None:
        raise ValueError(f"model.{key}: missing")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"model.{key}: expected an integer, got {show(v)}")
    if v < low:
        raise ValueError(f"model.{key}: expected an integer >= {low}, got {v}")
    return int(v)


def check_number(cfg, key, default, low=0.0):
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low < v < float("inf"):
        raise ValueError(f"model.{key}: expected a number > {low:g}, got {show(v)}")
    return float(v)


def check_rate(cfg, key, default):
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise ValueError(f"model.{key}: expected a number in [0, 1), got {show(v)}")
    return float(v)


def check_sparsity(cfg, c):
    """model.sparsity (fraction of zeros in each Linear weight, 0 <= s < 1) and model.sparsity_seed."""
    s = cfg.get("sparsity", 0.0)
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < 1:
        raise ValueError(f"model.sparsity: expected a number in [0, 1), got {show(s)}")
    c["sparsity"] = float(s)
    c["sparsity_seed"] = check_int(cfg, "sparsity_seed", low=0) if "sparsity_seed" in cfg else 0
    return 1.0 - c["sparsity"], c["sparsity_seed"]


def check_precision(cfg, c):
    """model.mixed_precision and model.fp16_type (float16 when not given, as Model Zoo before fp16_type)."""
    mixed = cfg.get("mixed_precision", False)
    if not isinstance(mixed, bool):
        raise TypeError(f"model.mixed_precision: expected true or false, got {show(mixed)}")
    kind = cfg.get("fp16_type")
    if kind is not None and kind not in FORMATS:
        raise ValueError(f"model.fp16_type: expected one of {', '.join(FORMATS)}, got {show(kind)}")
    c["mixed_precision"], c["fp16_type"] = mixed, (kind or "float16") if mixed else kind


def check_loss_scaling(cfg, c):
    """model.loss_scaling (num_tokens | batch_size) and model.loss_weight (Model Zoo's)."""
    scaling = cfg.get("loss_scaling", "num_tokens")
    if scaling not in ("num_tokens", "batch_size"):
        raise ValueError(f"model.loss_scaling: expected num_tokens or batch_size, got {show(scaling)}")
    weight = cfg.get("loss_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
        raise ValueError(f"model.loss_weight: expected a number > 0, got {show(weight)}")
    if scaling == "num_tokens" and weight != 1.0:
        raise ValueError(f"model.loss_weight: {show(weight)} has no effect with loss_scaling: num_tokens (Model Zoo "
                         "ignores it too); remove it, or use loss_scaling: batch_size")
    c["loss_scaling"], c["loss_weight"] = scaling, float(weight)
