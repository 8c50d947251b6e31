"""Files another process reads, written whole: to a temporary file beside the path, then renamed
over it, so a reader (a rank, ``wse bench faults``, an eval script) finds the old file or the new
one, never half of one (docs/design/checkpoints.md "The run directory")."""
import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def replacing(path):
    """A temporary path beside ``path`` to write; renamed over ``path`` when the block ends, removed
    if it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path, text):
    """``path`` holding ``text``, replaced whole."""
    with replacing(path) as tmp:
        tmp.write_text(text)
