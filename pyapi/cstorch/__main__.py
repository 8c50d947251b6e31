"""``python -m pyapi.cstorch SCRIPT [ARGS]``: run a script written for Cerebras' PyTorch API as it is,
every ``import cerebras.pytorch`` (or ``cerebras_pytorch``) in its files being this package. A
cluster's job that failed is one line, as `wse fit` says it, and exit code 1."""
import os
import runpy
import sys

import pyapi.cstorch  # noqa: F401  (installs the names: pyapi.cstorch.alias)
from pyapi.cstorch.errors import JobError


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) >= 2 else 2
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python SCRIPT` puts it
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except JobError as exc:  # the script's own errors keep their traceback: they are its author's to read
        print(f"cstorch: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
