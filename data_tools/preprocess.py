"""`wse data preprocess`: text (or arrays) in, HDF5 dataset shards out.

Text inputs are ``.txt`` files (one document each), ``.jsonl`` files (one document per line, in
the ``text`` field or ``--jsonl_key``), directories (searched recursively for both), glob
patterns, and ``stdlib``: the ``.py`` sources of this Python's standard library, a real corpus
that exists offline on every machine. Files are tokenized in parallel (``--processes``), each
document followed by the end-of-text id, and the stream is cut into examples of
``max_seq_length`` inputs whose labels are the inputs shifted by one: example i holds stream
positions [i*S, i*S + S] so every token is predicted exactly once. The last example is padded
(pad id = end-of-text, loss mask 0). Output does not depend on the number of processes.
``--seed N`` shuffles the examples with a fixed permutation before they are written.
"""
import glob
import json
import multiprocessing
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from data_tools.errors import DataError
from data_tools.lmdata import DATA_PARAMS, write_array_file, write_lm_file
from data_tools.tokenizers import get_tokenizer

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


def read_documents(path, jsonl_key):
    """The documents of one input file (invalid UTF-8 bytes become U+FFFD)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    text = raw.decode("utf-8", errors="replace")
    if Path(path).suffix != ".jsonl":
        return [text] if text else []
    docs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or jsonl_key not in obj:
            raise DataError(f"{path}:{lineno}: no '{jsonl_key}' field (set --jsonl_key)")
        if not isinstance(obj[jsonl_key], str):
            raise DataError(f"{path}:{lineno}: field '{jsonl_key}' is not a string")
        if obj[jsonl_key]:
            docs.append(obj[jsonl_key])
    return docs


def _tokenize_file(job):
    """Worker: token ids of every document of one file, each followed by end-of-text."""
    path, tokenizer, jsonl_key = job
    parts = []
    eot = np.array([tokenizer.eot_id], np.int32)
    for doc in read_documents(path, jsonl_key):
        parts += [tokenizer.encode_array(doc), eot]
    nbytes = Path(path).stat().st_size
    return (np.concatenate(parts) if parts else np.zeros(0, np.int32)), nbytes


class Progress:
    """Files and tokens so far, on one updating line (a tty) or every few seconds (a log)."""

    def __init__(self, total, stream=sys.stderr):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.last = 0.0 if self.tty else time.monotonic()  # a log gets its first line after 5 s

    def update(self, done, tokens, force=False):
        now = time.monotonic()
        if not force and now - self.last < (0.2 if self.tty else 5.0):
            return
        self.last = now
        width = 30
        filled = int(width * done / max(self.total, 1))
        line = f"preprocess [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} files, {tokens:,} tokens"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if force and self.tty:
            self.stream.write("\n")
        self.stream.flush()


class _Packer:
    """Cuts the token stream into [3, S] examples with stride S; the last one padded."""

    def __init__(self, seq_len, pad_id):
        self.s, self.pad = seq_len, pad_id
        self.pending = np.zeros(0, np.int32)

    def feed(self, tokens):
        """All whole examples the stream now allows, as an int32 array [n, 3, S]."""
        self.pending = np.concatenate([self.pending, tokens])
        s = self.s
        n = (len(self.pending) - 1) // s if len(self.pending) > s else 0
        out = np.empty((n, 3, s), np.int32)
        if n == 0:
            return out
        windows = np.lib.stride_tricks.sliding_window_view(self.pending, s + 1)[: n * s : s]
        out[:, 0] = windows[:, :s]
        out[:, 1] = 1
        out[:, 2] = windows[:, 1:]
        self.pending = self.pending[n * s:]
        return out

    def finish(self):
        """The padded last example (a single token left is already the previous example's last label)."""
        m = len(self.pending)
        out = np.empty((0, 3, self.s), np.int32)
        if m >= 2:
            out = np.full((1, 3, self.s), self.pad, np.int32)
            out[0, 1] = 0
            out[0, 0, :m] = self.pending
            out[0, 1, :m - 1] = 1
            out[0, 2, :m - 1] = self.pending[1:]
        return out


def preprocess_text(inputs, output_dir, max_seq_length, *, tokenizer="byte", samples_per_file=50000,
                    processes=1, seed=None, jsonl_key="text", compression="gzip", overwrite=False,
                    progress=True):
    """Tokenize, pack and write an LM dataset; returns the data_params dict (also written as JSON)."""
    if max_seq_length < 1 or samples_per_file < 1 or processes < 1:
        raise DataError("--max_seq_length, --samples_per_file and --processes must be >= 1")
    files = discover_inputs(inputs)
    tok = get_tokenizer(tokenizer)
    out = _prepare_output(output_dir, overwrite)
    t0 = time.perf_counter()
    packer = _Packer(max_seq_length, tok.eot_id)
    shards, buffer, all_examples = [], np.empty((0, 3, max_seq_length), np.int32), []
    n_tokens = nbytes = 0
    bar = Progress(len(files)) if progress else None

    pending = []  # writes in flight on the pool: (name, AsyncResult)

    def flush(force=False):
        nonlocal buffer
        while len(buffer) >= samples_per_file or (force and len(buffer)):
            chunk, buffer = buffer[:samples_per_file], buffer[samples_per_file:]
            name = f"data-{len(shards):05d}.h5"
            shards.append({"name": name, "n_examples": len(chunk)})
            job = (out / name, chunk, compression)
            if pool is None:
                write_lm_file(*job)
                continue
            # Compression dominates once tokens are cheap, so files are written on the pool too;
            # a bounded number in flight keeps memory flat.
            pending.append(pool.apply_async(write_lm_file, job))
            while len(pending) > 2 * processes:
                pending.pop(0).get()

    jobs = [(f, tok, jsonl_key) for f in files]
    pool = multiprocessing.get_context("spawn").Pool(processes) if processes > 1 else None
    try:
        results = pool.imap(_tokenize_file, jobs, chunksize=8) if pool else map(_tokenize_file, jobs)
        for done, (ids, size) in enumerate(results, start=1):
            n_tokens += len(ids)
            nbytes += size
            examples = packer.feed(ids)
            if seed is None:
                buffer = np.concatenate([buffer, examples])
                flush()
            else:
                all_examples.append(examples)
            if bar:
                bar.update(done, n_tokens)
        tail = packer.finish()
        if n_tokens < 2:
            raise DataError(f"--input {' '.join(map(str, inputs))}: no text found (all inputs are empty)")
        if seed is None:
            buffer = np.concatenate([buffer, tail])
        else:
            every = np.concatenate(all_examples + [tail])
            buffer = every[np.random.default_rng(seed).permutation(len(every))]
        flush(force=True)
        for result in pending:
            result.get()
    finally:
        if pool:
            pool.terminate()
    if bar:
        bar.update(len(files), n_tokens, force=True)
    params = {
        "format": "lm",
        "n_examples": sum(s["n_examples"] for s in shards),
        "n_tokens": n_tokens,
        "n_loss_tokens": n_tokens - 1,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "pad_id": tok.eot_id,
        "tokenizer": tok.name,
        "max_seq_length": max_seq_length,
        "compression": compression,
        "seed": seed,
        "input_files": len(files),
        "input_bytes": nbytes,
        "files": shards,
        "seconds": time.perf_counter() - t0,
    }
    (out / DATA_PARAMS).write_text(json.dumps(params, indent=2) + "\n")
    return params


def preprocess_arrays(npz_path, output_dir, *, samples_per_file=50000, compression="gzip", overwrite=False):
    """Write an array dataset (``features``, ``labels``) for ``fc_mlp`` from an ``.npz`` file."""
    path = Path(npz_path)
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None
    with npz:
        for key in ("features", "labels"):
            if key not in npz.files:
                raise DataError(f"{path}: no array '{key}' (found: {', '.join(npz.files) or 'nothing'})")
        x, y = npz["features"], npz["labels"]
    if x.ndim < 2 or len(x) != len(y) or y.ndim != 1:
        raise DataError(f"{path}: expected features [n, ...] and labels [n], got {x.shape} and {y.shape}")
    if not np.issubdtype(y.dtype, np.integer) or (len(y) and (y.min() < 0 or y.max() > np.iinfo(np.int32).max)):
        raise DataError(f"{path}: labels must be non-negative integers, got {y.dtype}")
    if len(y) == 0:
        raise DataError(f"{path}: no examples")
    out = _prepare_output(output_dir, overwrite)
    shards = []
    for i, lo in enumerate(range(0, len(y), samples_per_file)):
        name = f"data-{i:05d}.h5"
        write_array_file(out / name, x[lo:lo + samples_per_file], y[lo:lo + samples_per_file], compression)
        shards.append({"name": name, "n_examples": len(y[lo:lo + samples_per_file])})
    params = {"format": "arrays", "n_examples": int(len(y)), "feature_shape": list(x.shape[1:]),
              "num_classes": int(y.max()) + 1, "compression": compression, "files": shards}
    (out / DATA_PARAMS).write_text(json.dumps(params, indent=2) + "\n")
    return params


def _prepare_output(output_dir, overwrite):
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"--output_dir {out}: exists and is not a directory")
    existing = sorted(out.glob("*.h5")) + ([out / DATA_PARAMS] if (out / DATA_PARAMS).exists() else [])
    if existing and not overwrite:
        raise DataError(f"--output_dir {out}: already holds a dataset ({existing[0].name}); "
                        "choose another directory or pass --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for f in existing:
        f.unlink()
    return out
