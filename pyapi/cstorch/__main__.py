"""``python -m pyapi.cstorch SCRIPT [ARGS]``: run a script written for Cerebras' PyTorch API as it is,
every ``import cerebras.pytorch`` (or ``cerebras_pytorch``) in its files being this package."""
import os
import runpy
import sys

import pyapi.cstorch  # noqa: F401  (installs the names: pyapi.cstorch.alias)


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) >= 2 else 2
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python SCRIPT` puts it
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
