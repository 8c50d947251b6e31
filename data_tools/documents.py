"""The documents of `wse data preprocess`'s text inputs: which files the inputs name, and what each holds.

An input is a ``.txt`` file (one document), a ``.jsonl`` file (one document per line, in a string
field), a directory (searched recursively for both), a glob pattern, or ``stdlib``: the ``.py``
sources of this Python's standard library. ``read_documents`` reads a whole file, or the lines of a
``.jsonl`` that start in a byte range (a tokenizing job's piece: data_tools.preprocess.plan_jobs).
"""
import glob
import json
import os
import sysconfig
from pathlib import Path

from data_tools.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl")


def stdlib_sources():
    """The standard library's own .py files (no site-packages, no test suites), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]  # prune: site-packages can be huge
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def discover_inputs(specs):
    """Expand files, directories, globs and ``stdlib`` into a sorted, de-duplicated file list."""
    files = []
    for spec in specs:
        spec = str(spec)
        if spec == "stdlib":
            files.extend(stdlib_sources())
            continue
        path = Path(spec)
        if path.is_dir():
            files.extend(p for p in sorted(path.rglob("*")) if p.suffix in TEXT_SUFFIXES and p.is_file())
        elif path.is_file():
            files.append(path)
        elif glob.has_magic(spec):
            matched = [Path(p) for p in sorted(glob.glob(spec, recursive=True)) if Path(p).is_file()]
            if not matched:
                raise DataError(f"--input {spec}: the pattern matches no file")
            files.extend(matched)
        else:
            raise DataError(f"--input {spec}: no such file or directory")
    seen, unique = set(), []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    if not unique:
        raise DataError(f"--input {' '.join(map(str, specs))}: no .txt or .jsonl files found")
    return unique


def _line_range(f, lo, hi):
    """The bytes of the whole lines that start in [lo, hi) of an open binary file."""
    if lo > 0:
        f.seek(lo - 1)
        f.readline()  # the line under way at lo belongs to the range before
    start = f.tell()
    if start >= hi:
        return start, b""
    data = f.read(hi - start)
    if data and not data.endswith(b"\n"):
        data += f.readline()
    return start, data


def read_documents(path, jsonl_key, lo=0, hi=None):
    """The documents of one input file, or of the lines starting in bytes [lo, hi) of a ``.jsonl``
    (invalid UTF-8 bytes become U+FFFD)."""
    try:
        with open(path, "rb") as f:
            start, raw = (0, f.read()) if hi is None else _line_range(f, lo, hi)
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    text = raw.decode("utf-8", errors="replace")
    if Path(path).suffix != ".jsonl":
        return [text] if text else []
    docs = []
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON may hold U+2028 raw
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict) or jsonl_key not in obj:
                raise DataError(f"no '{jsonl_key}' field (set --jsonl_key)")
            if not isinstance(obj[jsonl_key], str):
                raise DataError(f"field '{jsonl_key}' is not a string")
        except ValueError as exc:  # bad JSON, or a DataError above: name the line in the whole file
            with open(path, "rb") as f:
                before = f.read(start).count(b"\n")
            why = str(exc) if isinstance(exc, DataError) else f"not valid JSON ({exc.msg})"
            raise DataError(f"{path}:{before + lineno}: {why}") from None
        if obj[jsonl_key]:
            docs.append(obj[jsonl_key])
    return docs
