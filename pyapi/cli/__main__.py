"""`python -m pyapi.cli ARGS`: the `wse` command without its installed script."""
import sys

from pyapi.cli import main

sys.exit(main())
