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
    def __init__(self):
        self.specs = {}  # alias -> the spec of the module it names, while the import system sets its own
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "cerebras":
            # the parent of cerebras.pytorch: an empty package, unless a real one (or a namespace,
            # Model Zoo's src/cerebras) is on the path
            if importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
                return None
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        aliased = _target(fullname)
        if aliased is not None:
            if _real(fullname, path):
                return None  # a real cerebras.pytorch or cerebras_pytorch: never shadowed
            _check_built(aliased, fullname)
            module = importlib.import_module(aliased)
            return importlib.util.spec_from_loader(fullname, self, is_package=hasattr(module, "__path__"))
        if fullname.startswith(HOME + "."):
            _check_built(fullname, fullname)
        return None

    def create_module(self, spec):
        if spec.name == "cerebras":
            module = types.ModuleType("cerebras", "Cerebras' namespace: its pytorch is pyapi.cstorch")
            module.__path__ = []
            return module
        module = importlib.import_module(_target(spec.name))
        self.specs[spec.name] = module.__spec__  # the import system sets the alias's: it is put back
        return module

    def exec_module(self, module):
        """Nothing to run: the module is this package's, imported already; its own spec put back."""
        alias = module.__spec__.name  # the import system set the alias's spec
        if alias in self.specs:
            module.__spec__ = self.specs.pop(alias)


def _real(fullname, path):
    """Whether ``fullname`` (one of Cerebras' names) is installed for real beside this project."""
    top = fullname.split(".")[0] if fullname.startswith("cerebras_pytorch") else "cerebras.pytorch"
    if fullname != top:  # a submodule: real if its package is
        return sys.modules.get(top) is not None and sys.modules.get(top) is not sys.modules.get(HOME)
    parent = sys.modules.get("cerebras") if top == "cerebras.pytorch" else None
    where = getattr(parent, "__path__", None) if parent is not None else None
    return importlib.machinery.PathFinder.find_spec(top, where) is not None


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
