"""``cstorch.utils``: the data loader and the executor that runs the steps."""
from pyapi.cstorch.utils import data  # noqa: F401
