"""``cstorch.utils``: the data loader and the executor that runs the steps (``data``), TensorBoard
summaries (``tensorboard``), nested structures (``nest``) and the 2.0-era ``CSConfig``."""
from dataclasses import dataclass, field

from pyapi.cstorch.utils import data, nest  # noqa: F401


@dataclass
class CSConfig:
    """Cerebras' 2.0-era cluster settings, given to ``DataExecutor(cs_config=...)``: ``num_csx``,
    ``max_wgt_servers`` and ``num_workers_per_csx`` size the emulated cluster; the others are taken
    and named in one line as meaning nothing here."""

    mgmt_address: str = None
    mgmt_namespace: str = None
    credentials_path: str = None
    num_csx: int = 1
    max_wgt_servers: int = 1
    max_act_per_csx: int = None
    transfer_processes: int = None
    num_workers_per_csx: int = 0
    job_time_sec: int = None
    mount_dirs: list = field(default_factory=list)
    python_paths: list = field(default_factory=list)
    job_labels: list = field(default_factory=list)
    debug_args: object = None
    precision_opt_level: int = None
    disable_version_check: bool = False
    job_priority: str = None
    workflow_id: str = None


def __getattr__(name):
    """A submodule not imported yet (``tensorboard``), or one line naming what is not built."""
    import importlib
    import importlib.machinery

    from pyapi.cstorch.errors import not_built

    if name.startswith("_"):
        raise AttributeError(name)
    if importlib.machinery.PathFinder.find_spec(f"{__name__}.{name}", __path__) is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise not_built(f"cstorch.utils.{name}", "built: data, tensorboard, nest, CSConfig")
