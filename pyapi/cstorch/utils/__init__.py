"""``cstorch.utils``: the data loader and the executor that runs the steps (``data``), TensorBoard
summaries (``tensorboard``), nested structures (``nest``) and the 2.0-era ``CSConfig``."""
import importlib
import importlib.machinery

from pyapi.cstorch.distributed import CSConfig  # noqa: F401  (the 2.0-era name of the cluster's settings)
from pyapi.cstorch.errors import refusing
from pyapi.cstorch.utils import data, nest  # noqa: F401


def __getattr__(name):
    """A submodule not imported yet (``tensorboard``), or one line naming what is not built."""
    if name.startswith("_"):
        raise AttributeError(name)
    if importlib.machinery.PathFinder.find_spec(f"{__name__}.{name}", __path__) is not None:
        return importlib.import_module(f"{__name__}.{name}")
    return _refused(name)


_refused = refusing("cstorch.utils", "built: data, tensorboard, nest, CSConfig")
