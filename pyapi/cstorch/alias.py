"""Cerebras' package names for this one: ``cerebras.pytorch`` (2.2 on) and ``cerebras_pytorch``
(2.0, 2.1) are ``pyapi.cstorch`` once it is imported, so the other files of a script (its model,
its data) run with their own ``import cerebras.pytorch as cstorch`` unchanged; and a module of
Cerebras' API not built here is one line when imported (``import cerebras.pytorch.sparse``), not a
bare ModuleNotFoundError.

Why on import and not by an environment variable: a variable would need a ``.pth`` file run by
every Python on the machine, and changes nothing a script can see that the import does not. A
script run unchanged (every file importing ``cerebras.pytorch``) is started by
``python -m pyapi.cstorch SCRIPT [ARGS]``, which imports this package first. A real
``cerebras.pytorch`` installed beside this project is never shadowed.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from pyapi.cstorch.errors import NotBuilt

#: Cerebras' names -> this package.
NAMES = {"cerebras.pytorch": "pyapi.cstorch", "cerebras_pytorch": "pyapi.cstorch"}
HOME = "pyapi.cstorch"


class NotBuiltModule(NotBuilt, ImportError):
    """A module of Cerebras' API that is not built here: one line naming it."""


def _target(fullname):
    for name, target in NAMES.items():
        if fullname == name or fullname.startswith(name + "."):
            return target + fullname[len(name):]
    return None


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "cerebras":
            # the parent of cerebras.pytorch: an empty package, unless a real one is installed
            if importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
                return None
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        aliased = _target(fullname)
        if aliased is not None:
            if fullname.startswith("cerebras.") and getattr(sys.modules.get("cerebras"), "__loader__", None) is not self:
                return None  # a real cerebras package: its own pytorch
            if fullname == "cerebras_pytorch" and importlib.machinery.PathFinder.find_spec(fullname) is not None:
                return None  # a real cerebras_pytorch
            if fullname.startswith("cerebras_pytorch.") and sys.modules.get("cerebras_pytorch") is not sys.modules[HOME]:
                return None
            _check_built(aliased, fullname)
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        if fullname.startswith(HOME + "."):
            _check_built(fullname, fullname)
        return None

    def create_module(self, spec):
        if spec.name == "cerebras":
            module = types.ModuleType("cerebras", "Cerebras' namespace: its pytorch is pyapi.cstorch")
            module.__path__ = []
            return module
        return importlib.import_module(_target(spec.name))

    def exec_module(self, module):
        """Nothing to run: the module is this package's, imported already."""


def _check_built(name, asked):
    """NotBuiltModule unless ``name`` (a module of this package) exists."""
    parent = importlib.import_module(name.rpartition(".")[0])
    if importlib.machinery.PathFinder.find_spec(name, getattr(parent, "__path__", None)) is None:
        raise NotBuiltModule(f"{asked.replace(HOME, 'cstorch', 1) if asked.startswith(HOME) else asked}: not built "
                             f"in wse-cluster (docs/user-guide.md lists what is)")


def install():
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
