"""`wse data preprocess`: text (or arrays) in, HDF5 dataset shards out.

Text inputs are ``.txt`` files (one document each), ``.jsonl`` files (one document per line, in
the ``text`` field or ``--jsonl_key``), directories (searched recursively for both), glob
patterns, and ``stdlib``: the ``.py`` sources of this Python's standard library, a real corpus
that exists offline on every machine. The inputs are cut into jobs of about JOB_BYTES, tokenized
by workers started once (``--processes``; a tokenizer.json encodes each job's documents as one
batch), each document followed by the end-of-text id; files are packed and written off the
tokenizing thread (docs/design/data.md "Preprocessing"). The stream is cut into examples of
``max_seq_length`` inputs whose labels are the inputs shifted by one: example i holds stream
positions [i*S, i*S + S] so every token is predicted exactly once. The last example is padded
(pad id = end-of-text, loss mask 0). Output does not depend on the number of processes.
``--seed N`` shuffles the examples with a fixed permutation before they are written.
Finding the inputs and reading their documents is data_tools.documents; the rest is one module
because it is one pipeline: the job plan (JOB_BYTES), the workers' tokenizing and the packing
writer decide together that the output does not depend on the number of processes.
"""
import collections
import json
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor
from pathlib import Path

import numpy as np

from data_tools.errors import DataError
from data_tools import DEFAULT_COMPRESSION
from data_tools.documents import discover_inputs, read_documents
from data_tools.files import write_text
from data_tools.lmdata import (DATA_PARAMS, SLAB_BYTES, LMFileWriter, chunk_rows, h5_filters, write_array_file)
from data_tools.tokenizers import get_tokenizer

JOB_BYTES = 4 << 20  # input bytes per tokenizing job: see docs/design/data.md "Preprocessing"
# Default examples per file: about this many bytes of int32 [n, 3, S]; see docs/design/data.md "Preprocessing"
FILE_BYTES = 64 << 20


def plan_jobs(files):
    """Tokenizing jobs of about JOB_BYTES of input each: ``.jsonl`` files cut at byte offsets (each
    job takes the lines that start in its range), small ``.txt`` files grouped. The plan depends on
    the inputs alone, so the output is the same for any number of processes."""
    jobs, current, size = [], [], 0
    for path in files:
        n = Path(path).stat().st_size
        pieces = ([(path, lo, min(lo + JOB_BYTES, n)) for lo in range(0, n, JOB_BYTES)]
                  if Path(path).suffix == ".jsonl" else [(path, 0, None)])
        for piece in pieces:
            current.append(piece)
            size += n if piece[2] is None else piece[2] - piece[1]
            if size >= JOB_BYTES:
                jobs.append(current)
                current, size = [], 0
    if current:
        jobs.append(current)
    return jobs


_worker = {}  # per process: the tokenizer and jsonl key, set once when the worker starts


def _init_worker(tokenizer, jsonl_key):
    _worker.update(tokenizer=tokenizer, jsonl_key=jsonl_key)


def _tokenize(job, spill=None):
    """Token ids of every document of a job, each followed by end-of-text, and the input bytes read.

    With ``spill`` (a path; pool workers) the ids go to that file and their count comes back
    instead: pickling every token through the pool's pipes to the main process and on to the
    writing worker cost more than the tokenizing (docs/design/data.md "Preprocessing")."""
    docs, nbytes = [], 0
    for path, lo, hi in job:
        docs += read_documents(path, _worker["jsonl_key"], lo, hi)
        nbytes += Path(path).stat().st_size if hi is None else hi - lo
    ids = _worker["tokenizer"].encode_docs(docs)
    if spill is None:
        return ids, nbytes
    ids.tofile(spill)
    return len(ids), nbytes


class _TokenStream:
    """The token stream as the parts the jobs made, in order: arrays (one process) or spill files."""

    def __init__(self):
        self.parts, self.end = [], 0  # parts: (stream offset, source, n)

    def add(self, source, n):
        self.parts.append((self.end, source, n))
        self.end += n

    def slice(self, lo, hi):
        """Stream tokens [lo, hi) as (source, offset, count) pieces, for ``gather``."""
        return [(src, max(lo, at) - at, min(hi, at + n) - max(lo, at)) for at, src, n in self.parts
                if at < hi and at + n > lo]

    def drop_before(self, pos):
        """Forget the parts wholly before stream position ``pos``; return their sources."""
        gone = [src for at, src, n in self.parts if at + n <= pos]
        self.parts = [p for p in self.parts if p[0] + p[2] > pos]
        return gone


def gather(pieces):
    """The tokens of ``_TokenStream.slice`` pieces, as one int32 array."""
    return np.concatenate([src[off:off + n] if isinstance(src, np.ndarray)
                           else np.fromfile(src, np.int32, n, offset=4 * off) for src, off, n in pieces])


def _in_order(pool, jobs, ahead, spill):
    """(spill file, tokens, input bytes) of each job, tokenized on the pool, in job order, with at
    most ``ahead`` jobs submitted and not yet taken: write jobs submitted meanwhile queue behind a
    few, not behind all of them."""
    def submit(k):
        path = spill / f"job-{k:07d}.int32"
        return path, pool.submit(_tokenize, jobs[k], path)

    pending = collections.deque(submit(k) for k in range(min(ahead, len(jobs))))
    for k in range(len(jobs)):
        path, result = pending.popleft()
        if k + ahead < len(jobs):
            pending.append(submit(k + ahead))
        yield (path, *result.result())


def n_packed(n_tokens, seq_len):
    """How many examples ``pack`` makes of a stream of ``n_tokens``."""
    full = (n_tokens - 1) // seq_len if n_tokens > seq_len else 0
    return full + (n_tokens - full * seq_len >= 2)


def pack(tokens, seq_len, pad_id, buffer=None):
    """Cut a token stream into int32 ``[n, 3, S]`` examples with stride S (example i holds stream
    positions [i*S, i*S + S]); a tail of 2 or more tokens becomes one padded example (a single
    token left over is already the previous example's last label). ``buffer``: int32 memory to
    pack into when large enough (reused, it spares the page faults of a fresh array)."""
    s = seq_len
    full = (len(tokens) - 1) // s if len(tokens) > s else 0
    tail = len(tokens) - full * s
    n = n_packed(len(tokens), s)
    if buffer is not None and buffer.size >= n * 3 * s:
        out = buffer[: n * 3 * s].reshape(n, 3, s)
    else:
        out = np.empty((n, 3, s), np.int32)
    if full:
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: full * s + 1], s + 1)[::s]
        out[:full, 0] = windows[:, :s]
        out[:full, 1] = 1
        out[:full, 2] = windows[:, 1:]
    if tail >= 2:
        rest = tokens[full * s:]
        out[full] = pad_id
        out[full, 1] = 0
        out[full, 0, :tail] = rest
        out[full, 1, :tail - 1] = 1
        out[full, 2, :tail - 1] = rest[1:]
    return out


def _slabs(data, seq_len):
    """(lo, hi) example ranges of about SLAB_BYTES, whole chunks each, over a file's examples."""
    n = n_packed(len(data), seq_len) if data.ndim == 1 else len(data)
    rows = chunk_rows((3, seq_len))
    rows *= max(1, SLAB_BYTES // (rows * 12 * seq_len))
    return n, [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]


def _slab(data, lo, hi, seq_len, pad_id, buffer):
    """Examples [lo, hi) of a file: packed from its token stream into ``buffer``, or a view of ready examples."""
    if data.ndim == 3:
        return data[lo:hi]
    return pack(data[lo * seq_len: hi * seq_len + 1], seq_len, pad_id, buffer)


def _write_shard(path, data, seq_len, pad_id, compression):
    """Pack (stream pieces, slab by slab into one buffer) and write one .h5 file, on a pool worker."""
    if isinstance(data, list):
        data = gather(data)
    n, slabs = _slabs(data, seq_len)
    buffer = np.empty(3 * seq_len * (slabs[0][1] - slabs[0][0]), np.int32) if data.ndim == 1 else None
    w = LMFileWriter(path, n, seq_len, compression)
    try:
        for lo, hi in slabs:
            w.write(_slab(data, lo, hi, seq_len, pad_id, buffer))
    except BaseException:
        w.abort()
        raise
    w.close()


class _Writer:
    """Writes shards off the tokenizing thread: the pool's workers pack and write whole files; in
    one process the main thread packs slabs into a ring of buffers and a writer thread writes them
    (h5py lets go of the GIL while HDF5 works, so both cores work). A few files or slabs in flight
    keep memory flat."""

    def __init__(self, pool, depth):
        self.pool, self.depth, self.pending, self.error = pool, depth, [], None
        if pool is None:
            self.work, self.free, self.n_buffers = queue.Queue(), queue.Queue(), 0
            self.thread = threading.Thread(target=self._run, name="wse-preprocess-writer", daemon=True)
            self.thread.start()

    def submit(self, path, data, seq_len, pad_id, compression, spent=()):
        """Write one file; ``spent``: spill files to delete once it (and every file before) is written."""
        if self.pool is not None:
            self.pending.append((self.pool.submit(_write_shard, path, data, seq_len, pad_id, compression), spent))
            while len(self.pending) > self.depth:
                self._collect()
            return
        if isinstance(data, list):
            data = gather(data)
        n, slabs = _slabs(data, seq_len)
        size = 3 * seq_len * (slabs[0][1] - slabs[0][0])
        for lo, hi in slabs:
            buffer = None
            if data.ndim == 1:
                if self.free.empty() and self.n_buffers < self.depth + 2:
                    self.free.put(np.empty(size, np.int32))
                    self.n_buffers += 1
                buffer = self.free.get()
                if buffer.size < size:
                    buffer = np.empty(size, np.int32)
            self._raise()
            self.work.put((path, n, seq_len, compression, _slab(data, lo, hi, seq_len, pad_id, buffer), buffer))

    def _run(self):
        w = None
        while (item := self.work.get()) is not None:
            path, n, seq_len, compression, examples, buffer = item
            try:
                if self.error is None:
                    if w is None:
                        w = LMFileWriter(path, n, seq_len, compression)
                    w.write(examples)
                    if w.done == n:
                        done, w = w, None
                        done.close()
            except BaseException as exc:  # handed to the main thread at its next submit or finish
                self.error = exc
                if w is not None:
                    w.abort()
                    w = None
            if buffer is not None:
                self.free.put(buffer)  # also after a failure: the main thread waits for buffers

    def finish(self):
        """Wait for every write; raise the first failure."""
        self.close()
        self._raise()
        while self.pending:
            self._collect()

    def _collect(self):
        result, spent = self.pending.pop(0)
        result.result()
        for path in spent:
            os.unlink(path)

    def close(self):
        """Stop the writer thread once its queue is written (or skipped, after a failure)."""
        if self.pool is None and self.thread.is_alive():
            self.work.put(None)
            self.thread.join()

    def _raise(self):
        if self.error is not None:
            raise self.error


class Progress:
    """Input read so far, its rate and the time left, on one updating line (a tty) or every few
    seconds (a log)."""

    def __init__(self, total_bytes, stream=sys.stderr):
        self.total, self.stream = total_bytes, stream
        self.tty = stream.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0 if self.tty else self.t0  # a log gets its first line after 5 s

    def update(self, done, tokens, force=False):
        now = time.monotonic()
        if not force and now - self.last < (0.2 if self.tty else 5.0):
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else 0.0
        width = 30
        filled = int(width * done / max(self.total, 1))
        line = (f"preprocess [{'#' * filled}{'.' * (width - filled)}] {done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB, "
                f"{tokens:,} tokens, {rate / 1e6:.1f} MB/s, "
                + (f"{now - self.t0:.0f} s" if force else f"ETA {int(eta) // 60}:{int(eta) % 60:02d}"))
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if force and self.tty:
            self.stream.write("\n")
        self.stream.flush()


def _pool(processes, tokenizer, jsonl_key):
    """Workers started once for the whole run: forked where the OS allows (no re-import), spawned elsewhere.

    An executor, not ``multiprocessing.Pool``: when a worker dies (killed, out of memory) the
    executor breaks and every wait raises, where a Pool starts a new worker and waits forever for
    the task the dead one held. A first task starts the workers here (forking them all at once,
    before the executor's thread or any of ours exists)."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context(method), initializer=_init_worker,
                               initargs=(tokenizer, jsonl_key))
    pool.submit(int).result()
    return pool


class _Shards:
    """The dataset's files, cut from the token stream as it grows and handed to the writer in order.

    Unshuffled, file k holds stream tokens [k*P*S, (k+1)*P*S] (its last is also the next file's
    first) and goes out as soon as the stream holds it; shuffled (``seed``), every example waits for
    the whole stream. ``spill``: the stream's parts are spill files, deleted once written."""

    def __init__(self, out, writer, seq_len, samples_per_file, pad_id, compression, seed, spill):
        self.out, self.writer, self.compression, self.seed, self.spill = out, writer, compression, seed, spill
        self.s, self.pad_id, self.samples_per_file = seq_len, pad_id, samples_per_file
        self.per_file = samples_per_file * seq_len  # stream tokens each file advances
        self.entries = []  # data_params.json's "files": each file's name and example count
        self.stream, self.written = _TokenStream(), 0  # written: where the next file starts in the stream

    def add(self, source, n):
        """Append a job's ``n`` tokens; write every file they complete."""
        self.stream.add(source, n)
        while self.seed is None and self.stream.end - self.written > self.per_file:
            pieces = self.stream.slice(self.written, self.written + self.per_file + 1)
            self.written += self.per_file
            spent = self.stream.drop_before(self.written)
            self._write(pieces, self.samples_per_file, spent if self.spill else ())

    def finish(self):
        """Write the rest of the stream: its tail (unshuffled), or all of it shuffled."""
        stream, written, s = self.stream, self.written, self.s
        if self.seed is None:
            if stream.end - written >= 2:
                self._write(stream.slice(written, stream.end), n_packed(stream.end - written, s))
            return
        every = pack(gather(stream.slice(0, stream.end)), s, self.pad_id)
        every = every[np.random.default_rng(self.seed).permutation(len(every))]
        for lo in range(0, len(every), self.samples_per_file):
            self._write(every[lo:lo + self.samples_per_file], len(every[lo:lo + self.samples_per_file]))

    def _write(self, pieces, n_examples, spent=()):
        name = f"data-{len(self.entries):05d}.h5"
        self.entries.append({"name": name, "n_examples": n_examples})
        self.writer.submit(self.out / name, pieces, self.s, self.pad_id, self.compression, spent)


def preprocess_text(inputs, output_dir, max_seq_length, *, tokenizer="byte", samples_per_file=None,
                    processes=1, seed=None, jsonl_key="text", compression=DEFAULT_COMPRESSION, overwrite=False,
                    progress=True):
    """Tokenize, pack and write an LM dataset; returns the data_params dict (also written as JSON).

    ``samples_per_file`` defaults to about FILE_BYTES of examples per file.
    """
    if samples_per_file is None:
        samples_per_file = max(1, FILE_BYTES // (12 * max(max_seq_length, 1)))
    if max_seq_length < 1 or samples_per_file < 1 or processes < 1:
        raise DataError("--max_seq_length, --samples_per_file and --processes must be >= 1")
    h5_filters(compression)  # a bad --compression is refused before any work
    files = discover_inputs(inputs)
    tok = get_tokenizer(tokenizer)
    out = _prepare_output(output_dir, overwrite)
    t0 = time.perf_counter()
    jobs = plan_jobs(files)
    total_bytes = sum(Path(f).stat().st_size for f in files)
    bar = Progress(total_bytes) if progress else None
    n_tokens = nbytes = 0

    pool = writer = spill = None
    try:
        # Fork the workers before any thread exists; then the writer.
        pool = _pool(processes, tok, jsonl_key) if processes > 1 else None
        writer = _Writer(pool, depth=2 * processes)
        shards = _Shards(out, writer, max_seq_length, samples_per_file, tok.eot_id, compression, seed,
                         spill=pool is not None)
        results, spill = _tokenized(jobs, pool, 2 * processes, tok, jsonl_key, out)
        for source, n, size in results:
            n_tokens += n
            nbytes += size
            shards.add(source, n)
            if bar:
                bar.update(nbytes, n_tokens)
        if n_tokens < 2:
            raise DataError(f"--input {' '.join(map(str, inputs))}: no text found (all inputs are empty)")
        shards.finish()
        writer.finish()
    except BrokenProcessPool as exc:
        raise DataError(f"--output_dir {out}: a worker process died (killed, or out of memory); the dataset "
                        "there is incomplete (no data_params.json): run again with --overwrite") from exc
    finally:
        if writer:
            writer.close()
        if pool:
            pool.shutdown(cancel_futures=True)  # after a failure: waits only for the tasks under way
        if spill:
            shutil.rmtree(spill, ignore_errors=True)
    if bar:
        bar.update(nbytes, n_tokens, force=True)
    params = _lm_params(tok, shards.entries, n_tokens, nbytes, max_seq_length=max_seq_length, compression=compression,
                        seed=seed, input_files=len(files), t0=t0)
    write_text(out / DATA_PARAMS, json.dumps(params, indent=2) + "\n")
    return params


def _tokenized(jobs, pool, ahead, tok, jsonl_key, out):
    """(source, tokens, input bytes) of each job, in job order: ids tokenized here without a pool, spill
    files written by its workers with one (``ahead`` jobs at most submitted and not yet taken); and the
    spill directory (None without a pool) to remove after."""
    if pool is None:
        _init_worker(tok, jsonl_key)
        return ((ids, len(ids), size) for ids, size in map(_tokenize, jobs)), None
    spill = Path(tempfile.mkdtemp(prefix=".tokens-", dir=out))
    return _in_order(pool, jobs, ahead, spill), spill


def _lm_params(tok, shards, n_tokens, nbytes, *, max_seq_length, compression, seed, input_files, t0):
    """data_params.json of an LM dataset (``shards``: each file's name and example count)."""
    return {
        "format": "lm",
        "n_examples": sum(sh["n_examples"] for sh in shards),
        "n_tokens": n_tokens,
        "n_loss_tokens": n_tokens - 1,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "pad_id": tok.eot_id,
        "tokenizer": tok.name,
        "max_seq_length": max_seq_length,
        "compression": compression,
        "seed": seed,
        "input_files": input_files,
        "input_bytes": nbytes,
        "files": shards,
        "seconds": time.perf_counter() - t0,
    }


def preprocess_arrays(npz_path, output_dir, *, samples_per_file=None, compression=DEFAULT_COMPRESSION,
                      overwrite=False):
    """Write an array dataset (``features``, ``labels``) for ``fc_mlp`` from an ``.npz`` file;
    ``samples_per_file`` defaults to about FILE_BYTES of features per file."""
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
    if samples_per_file is None:
        samples_per_file = max(1, FILE_BYTES // (4 * int(np.prod(x.shape[1:]))))
    if samples_per_file < 1:
        raise DataError("--samples_per_file must be >= 1")
    h5_filters(compression)
    out = _prepare_output(output_dir, overwrite)
    shards = []
    for i, lo in enumerate(range(0, len(y), samples_per_file)):
        name = f"data-{i:05d}.h5"
        write_array_file(out / name, x[lo:lo + samples_per_file], y[lo:lo + samples_per_file], compression)
        shards.append({"name": name, "n_examples": len(y[lo:lo + samples_per_file])})
    params = {"format": "arrays", "n_examples": int(len(y)), "feature_shape": list(x.shape[1:]),
              "num_classes": int(y.max()) + 1, "compression": compression, "files": shards}
    write_text(out / DATA_PARAMS, json.dumps(params, indent=2) + "\n")
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
