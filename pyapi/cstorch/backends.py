"""``cstorch.backends``: Cerebras' global flags (2.3 on), ``cstorch.backends.csx.<group>.<flag>``.

``csx.performance.micro_batch_size`` is the emulated cluster's micro-batch (when neither the
backend nor the DataExecutor sets one); every other flag tunes a real compile, its precision
passes or its cluster's memory, and is taken as set (a flag of another name is an
AttributeError, as on a real system) with no effect here: nothing is compiled for a wafer.
"""
import copy

from pyapi.cstorch.errors import not_built


#: Assigning it to a flag gives the flag its default back (``cstorch.backends.DEFAULT``).
DEFAULT = object()


class _Group:
    """A group of flags: known names, their defaults; an unknown name is an AttributeError."""

    def __init__(self, path, **defaults):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_defaults", defaults)
        object.__setattr__(self, "_values", dict(defaults))

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"cstorch.backends.{self._path} has no flag {name!r} (flags: {', '.join(values)})")

    def __setattr__(self, name, value):
        if name not in self._values:
            raise AttributeError(f"cstorch.backends.{self._path} has no flag {name!r} (flags: "
                                 f"{', '.join(self._values)})")
        self._values[name] = copy.deepcopy(self._defaults[name]) if value is DEFAULT else value

    def reset(self):
        self._values.clear()
        self._values.update(copy.deepcopy(self._defaults))

    def asdict(self):
        return dict(self._values)


class _Csx:
    def __init__(self):
        self.performance = _Group("csx.performance", micro_batch_size="auto", transfer_processes=5,
                                  use_speculative_optimizers=True, max_transfer_bytes=None, compress_weights=False)
        self.precision = _Group("csx.precision", optimization_level=1)
        self.debug = _Group("csx.debug", ini=None, debug_args=None, drop_data=False, lazy_initialization=True,
                            skip_weight_init=False, optimize_initialization=True, async_parallel_compute=False,
                            log_initialization=True, retrace_every_iteration=False, fabric_type_blacklist=None,
                            compile_crd_memory_gi=None, execute_crd_memory_gi=None, wrk_memory_gi=None,
                            act_memory_gi=None, cmd_memory_gi=None, wgt_memory_gi=None,
                            implicit_cast_cb16_to_fp32=False, save_gpv=True, skip_connectivity_check=False)
        self.cluster = _Group("csx.cluster", automount_all=True, auto_taint=False)

    def groups(self):
        return (self.performance, self.precision, self.debug, self.cluster)


class _Backends:
    def __init__(self):
        self.csx = _Csx()
        self.DEFAULT = DEFAULT  # assigning it to a flag gives the flag its default back

    def reset(self):
        for group in self.csx.groups():
            group.reset()

    def asdict(self):
        return {"csx": {g._path.split(".")[1]: g.asdict() for g in self.csx.groups()}}

    def __enter__(self):
        self._saved = [g.asdict() for g in self.csx.groups()]
        return self

    def __exit__(self, *exc):
        for group, values in zip(self.csx.groups(), self._saved):
            group._values.clear()
            group._values.update(values)


backends = _Backends()


def flagged_micro_batch_size():
    """The micro-batch the flags set: an integer, or None (the backend's default)."""
    value = backends.csx.performance.micro_batch_size
    if value in (None, "auto"):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise not_built(f"cstorch.backends.csx.performance.micro_batch_size = {value!r}",
                        "an integer >= 1, or \"auto\"")
    return value
