"""``cstorch.backend`` and ``cstorch.compile``: where the steps run, and the model they train."""
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from pyapi.cstorch import amp
from pyapi.cstorch.distributed import ClusterConfig, CSConfig
from pyapi.cstorch.errors import not_built
from wse_core.errors import ConfigError

_current = None


class Backend:
    """Where the steps run: ``CSX`` (the emulated cluster: MPI ranks for the CS-2s, MemoryX and SwarmX)
    or ``CPU`` (the same steps, the reference's, in this process: the bits of the cluster's)."""

    def __init__(self, backend_type, artifact_dir, cluster_config, runconfig, micro_batch_size, appliance=None):
        self.backend_type = backend_type
        self.appliance = appliance  # a running appliance's socket (True: the default one), or None
        self.artifact_dir = Path(artifact_dir).absolute()
        self.cluster_config = cluster_config
        self.runconfig = runconfig  # this project's other cluster keys (runconfig.*), checked with the params
        self.micro_batch_size = micro_batch_size
        self.models = []
        # A compile (capture, units, the plan `wse compile` checks) or a validation (capture alone),
        # and nothing run: the executor takes one step, whose values are NaN and closures not run.
        self.compile_only = self.validate_only = False

    @property
    def is_e2e_execution(self):
        return not (self.compile_only or self.validate_only)

    @property
    def is_csx(self):
        return self.backend_type == "CSX"

    @property
    def is_cpu(self):
        return self.backend_type == "CPU"

    @property
    def is_gpu(self):
        return False

    @property
    def device(self):
        """Where the script's tensors live: this process's CPU (the cluster's ranks take the weights
        and batches from it). A ``torch.device``, so ``with backend.device:`` and ``.to(backend.device)``
        work as on a real system."""
        return current_torch_device()

    torch_device = device

    def take_cs_config(self, cs_config):
        """A 2.0-era ``cstorch.utils.CSConfig`` given to the DataExecutor: the backend's cluster."""
        if not isinstance(cs_config, CSConfig):
            raise TypeError(f"DataExecutor: cs_config: expected a cstorch.utils.CSConfig, got {type(cs_config).__name__}")
        self.cluster_config = cs_config
        _say_ignored(cs_config, "cstorch.utils.CSConfig")

    def run_config(self):
        """The ``runconfig`` keys this backend sets."""
        c = self.cluster_config
        return {**self.runconfig, "num_csx": c.num_csx, "num_wgt_servers": c.max_wgt_servers,
                "num_workers_per_csx": c.workers}

    def __repr__(self):
        return f"cstorch.backend({self.backend_type!r}, cluster_config={asdict(self.cluster_config)})"


def backend(backend_type=None, *, artifact_dir=None, cluster_config=None, num_csx=None, micro_batch_size=None,
            appliance=None, compile_dir=None, compile_only=False, validate_only=False, drop_data=None,
            log_initialization=None, max_checkpoints=None, use_cs_grad_accum=None, retrace_every_iteration=False,
            mixed_precision=None, **runconfig):
    """The backend the steps run on: ``"CSX"`` or ``"CPU"``. ``cluster_config`` (a ClusterConfig) or
    ``num_csx`` size the cluster; ``micro_batch_size`` splits each CS-2's share of the batch (default:
    all of it); ``artifact_dir`` (default ./cerebras_logs) holds the program, the data and the run;
    ``appliance`` queues the job on a running appliance (its socket, or True for the default one:
    ``$WSE_APPLIANCE_SOCKET``, this user's, the machine's) instead of starting the ranks here;
    other keywords are this project's ``runconfig`` keys (``swarmx_fanout``, ``execution_strategy``, ...).
    ``compile_only``/``validate_only``: the step is captured and cut into units (and, compiling, the
    cluster planned and checked as ``wse compile`` does), nothing runs.
    Without arguments: the current backend. Cerebras' other keywords of 2.0-2.3 are taken: those that
    tune a real compile or its logging (``compile_dir``, ``drop_data``, ``log_initialization``,
    ``max_checkpoints``, ``use_cs_grad_accum``) with one line saying they mean nothing here;
    ``mixed_precision=True`` as ``cstorch.amp.set_half_dtype`` of the half dtype set (float16 if none)."""
    global _current
    if backend_type is None:
        if _current is None:
            raise RuntimeError("cstorch.backend(): no backend yet; create one: cstorch.backend(\"CSX\")")
        return _current
    kind = str(backend_type).upper()
    if kind not in ("CSX", "CPU"):
        raise not_built(f"cstorch.backend({backend_type!r})", "backends CSX and CPU")
    if compile_only and validate_only:
        raise ConfigError("cstorch.backend: give one of compile_only and validate_only")
    if retrace_every_iteration:
        raise not_built("retrace_every_iteration=True", "one graph, captured on the first step")
    tuning = [k for k, v in (("compile_dir", compile_dir), ("drop_data", drop_data),
                             ("log_initialization", log_initialization), ("max_checkpoints", max_checkpoints),
                             ("use_cs_grad_accum", use_cs_grad_accum)) if v is not None]
    if tuning:
        print(f"cstorch.backend: {', '.join(tuning)}: taken, and meaningless on the emulated cluster (nothing is "
              "compiled for a wafer)", file=sys.stderr)
    if mixed_precision:
        amp.set_half_dtype(amp.get_half_dtype_str())  # the half dtype set, float16 if none
    if cluster_config is None:
        cluster_config = ClusterConfig(num_csx=1 if num_csx is None else num_csx)  # the params check the value
    elif not isinstance(cluster_config, ClusterConfig):
        raise TypeError(f"cstorch.backend: cluster_config: expected a cstorch.distributed.ClusterConfig, got "
                        f"{type(cluster_config).__name__}")
    elif num_csx is not None and num_csx != cluster_config.num_csx:
        raise ConfigError(f"cstorch.backend: num_csx {num_csx} beside cluster_config.num_csx "
                          f"{cluster_config.num_csx}; give one")
    if kind == "CPU" and (cluster_config.num_csx != 1 or appliance):
        raise ConfigError("cstorch.backend(\"CPU\"): one process, no CS-2s; give num_csx and appliance to \"CSX\"")
    _current = Backend(kind, artifact_dir or "cerebras_logs", cluster_config, runconfig, micro_batch_size, appliance)
    _current.compile_only, _current.validate_only = bool(compile_only), bool(validate_only)
    _say_ignored(cluster_config, "cstorch.distributed.ClusterConfig")
    return _current


def _say_ignored(config, who):
    """One line naming the settings of a real cluster that mean nothing on the emulated one."""
    ignored = config.ignored()
    if ignored:
        print(f"{who}: {', '.join(ignored)}: taken, and meaningless on the emulated cluster (its ranks run on this "
              "machine, in this Python)", file=sys.stderr)


def current_torch_device():
    """The torch device of the script's tensors: the CPU (the emulated CS-2s take them from there)."""
    return torch.device("cpu")


_backend = backend  # compile's own parameter is called backend, as Cerebras' is


def current_backend():
    return backend()


def use_cs():
    """True when the current backend is the (emulated) cluster."""
    return _current is not None and _current.is_csx


class CompiledModel:
    """What ``compile`` returns: calls go to the model (``compiled(x)``), and its methods too."""

    def __init__(self, module, backend):
        self.module, self.backend = module, backend

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)


def compile(model, backend=None):
    """Prepare ``model`` (a torch.nn.Module) for ``backend`` (default: the current one; a name: the
    current one if of that kind, else a new one). As on a real system nothing is compiled yet: the
    graph is captured on the traced step's first call."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cstorch.compile: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(backend, str):  # the backend of that kind made already, or a new one (as Cerebras')
        same = _current is not None and _current.backend_type == backend.upper()
        backend = _current if same else _backend(backend)
    backend = backend or _backend()
    # The model the next loops train; the others compiled before stay known, so a step that reads
    # their weights (which the cluster would hold as constants) is refused (``Run._start``).
    backend.models = [model] + [m for m in backend.models if m is not model]
    return CompiledModel(model, backend)
