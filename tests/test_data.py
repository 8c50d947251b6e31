"""Dataset preprocessing, verification and the loader, with the errors a user meets.

One file over ~500 lines: the three share the files they make (shards written by preprocessing are
what verification and the loader read), so each fixture is built once."""
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from data_tools.dataset import Dataset, GlobalStream, inspect_dataset
from data_tools.errors import DataError
from data_tools.lmdata import read_meta, verify_dataset, write_lm_file
from data_tools.preprocess import preprocess_arrays, preprocess_text

EOT = 256


def wse(*args):
    return subprocess.run([sys.executable, "-m", "pyapi.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def corpus(tmp_path):
    """A .txt file, a .jsonl file and a directory with more text; returns (inputs, expected token stream)."""
    rng = np.random.default_rng(0)
    words = ["wafer", "scale", "engine", "memory", "swarm", "é", "→", "stream", "weights", "\n"]
    docs = [" ".join(rng.choice(words, size=int(rng.integers(5, 400)))) for _ in range(7)]
    (tmp_path / "a.txt").write_text(docs[0], encoding="utf-8")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[1:4]) + "\n")
    sub = tmp_path / "more"
    sub.mkdir()
    for i, d in enumerate(docs[4:]):
        (sub / f"c{i}.txt").write_text(d, encoding="utf-8")
    stream = []
    for d in docs:
        stream += list(d.encode("utf-8")) + [EOT]
    return [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), str(sub)], np.array(stream, np.int32)


def unpack(examples):
    """The token stream back from packed examples (stride S, last one padded with mask 0)."""
    s = examples.shape[2]
    m = int(examples[-1, 1].sum())
    return np.concatenate([examples[:-1, 0].reshape(-1), examples[-1, 0, :m], examples[-1, 2, m - 1:m]]) \
        if m < s else np.concatenate([examples[:, 0].reshape(-1), examples[-1, 2, -1:]])


def test_round_trip(tmp_path, corpus):
    """preprocess -> verify -> load gives back exactly the token stream of the inputs."""
    inputs, stream = corpus
    params = preprocess_text(inputs, tmp_path / "out", 64, samples_per_file=7, progress=False)
    assert params["n_tokens"] == len(stream) and params["vocab_size"] == 257
    assert verify_dataset(tmp_path / "out")["n_examples"] == params["n_examples"]
    ds = Dataset(tmp_path / "out")
    assert len(ds.files) == -(-params["n_examples"] // 7)
    np.testing.assert_array_equal(unpack(ds.read(0, ds.n_examples)), stream)
    loader = GlobalStream(tmp_path / "out")
    np.testing.assert_array_equal(unpack(loader.read(0, ds.n_examples)), stream)
    loader.close()
    with h5py.File(ds.files[0]) as f:  # one chunk holds many examples (here the file's 7), checksummed
        assert f.attrs["n_examples"] == 7 and f["data"].chunks == (7, 3, 64) and f["data"].fletcher32


def test_same_output_for_any_number_of_processes(tmp_path, corpus):
    inputs, _ = corpus
    a = preprocess_text(inputs, tmp_path / "p1", 32, samples_per_file=5, processes=1, progress=False)
    preprocess_text(inputs, tmp_path / "p2", 32, samples_per_file=5, processes=2, progress=False)
    for shard in a["files"]:
        assert (tmp_path / "p1" / shard["name"]).read_bytes() == (tmp_path / "p2" / shard["name"]).read_bytes()


def test_seed_shuffles_examples_deterministically(tmp_path, corpus):
    inputs, _ = corpus
    for name in ("s1", "s2", "plain"):
        preprocess_text(inputs, tmp_path / name, 32, seed=None if name == "plain" else 5, progress=False)
    read = {n: Dataset(tmp_path / n).read(0, Dataset(tmp_path / n).n_examples) for n in ("s1", "s2", "plain")}
    np.testing.assert_array_equal(read["s1"], read["s2"])
    assert not np.array_equal(read["s1"], read["plain"])
    assert sorted(map(bytes, read["s1"])) == sorted(map(bytes, read["plain"]))


def test_stdlib_corpus_and_inspect(tmp_path):
    params = preprocess_text(["stdlib"], tmp_path / "std", 128, samples_per_file=100000, progress=False)
    assert params["input_files"] > 100 and params["n_tokens"] > 1_000_000
    info = inspect_dataset(tmp_path / "std")
    assert info["n_examples"] == params["n_examples"] and info["vocab_size"] == 257
    assert isinstance(info["example_0_text"], str) and len(info["example_0_text"]) > 50


def test_arrays_format(tmp_path):
    x = np.random.default_rng(1).standard_normal((50, 4, 3)).astype(np.float32)
    y = np.arange(50) % 7
    np.savez(tmp_path / "xy.npz", features=x, labels=y)
    params = preprocess_arrays(tmp_path / "xy.npz", tmp_path / "arr", samples_per_file=20)
    assert params["num_classes"] == 7 and len(params["files"]) == 3
    assert verify_dataset(tmp_path / "arr") == {"format": "arrays", "files": 3, "n_examples": 50}
    stream = GlobalStream(tmp_path / "arr")
    features, labels = stream.read(0, 50)
    stream.close()
    np.testing.assert_array_equal(features, x)
    np.testing.assert_array_equal(labels, y)


# --- the loader -----------------------------------------------------------------------------------

@pytest.fixture
def lm_dir(tmp_path):
    """5 files of 6, 6, 6, 6, 3 examples whose first input id is the example's global number."""
    d = tmp_path / "lm"
    d.mkdir()
    n = 0
    for i, count in enumerate([6, 6, 6, 6, 3]):
        ex = np.zeros((count, 3, 4), np.int32)
        ex[:, 0, 0] = np.arange(n, n + count)
        n += count
        write_lm_file(d / f"data-{i:05d}.h5", ex)
    return d


def ids(batch):
    return batch["input_ids"][:, 0].tolist()


def test_a_list_of_directories_is_one_dataset(lm_dir, tmp_path):
    """Model Zoo's data_dir may list directories: their files, in the list's order, are one dataset;
    directories of different formats are refused, naming the odd one."""
    more = tmp_path / "more"
    more.mkdir()
    ex = np.zeros((4, 3, 4), np.int32)
    ex[:, 0, 0] = np.arange(27, 31)
    write_lm_file(more / "data-00000.h5", ex)
    stream = GlobalStream([str(lm_dir), str(more)])
    assert stream.n == 31 and stream.read(0, 31)[:, 0, 0].tolist() == list(range(31))
    stream.close()
    x = np.zeros((5, 2), np.float32)
    np.savez(tmp_path / "xy.npz", features=x, labels=np.arange(5) % 2)
    preprocess_arrays(tmp_path / "xy.npz", tmp_path / "arr")
    with pytest.raises(DataError, match=r"arr: arrays data, where .*lm holds lm data"):
        Dataset([lm_dir, tmp_path / "arr"])
    with pytest.raises(DataError, match="data_dir: an empty list"):
        Dataset([])


def worker_reads(data, steps, batch, num_csx, workers, start=0, window=2, shuffle=True, seed=3, mixture=None):
    """What the cluster's input workers read for steps [start, steps): each its own GlobalStream,
    micro-batch m of CS-2 c to worker m mod w (mpi_launch/roles/worker.py), reassembled per step."""
    per_csx = batch // num_csx
    mbs = min(2, per_csx)
    streams = [GlobalStream(data, mixture=mixture, shuffle=shuffle, seed=seed, window=window)
               for _ in range(num_csx * workers)]
    out = []
    for step in range(start, steps):
        parts = {}
        for c in range(num_csx):
            for j in range(workers):
                for m in range(j, per_csx // mbs, workers):
                    base = step * batch + c * per_csx + m * mbs
                    parts[base] = streams[c * workers + j].read(base, mbs)
        out.append(np.concatenate([parts[k] for k in sorted(parts)]))
    for s in streams:
        s.close()
    return np.concatenate(out)


@pytest.mark.parametrize("window", [1, 2, 64])
def test_every_example_once_per_epoch_for_any_workers_and_resume_point(lm_dir, window):
    """The stream is a function of (seed, epoch) alone: any number of CS-2s and input workers read
    the same examples, every epoch holds each example exactly once, and a run resumed at any step
    reads what the uninterrupted run read from there."""
    n, batch, steps = 27, 4, 20  # 80 examples: into the third epoch, batches straddling epochs
    want = worker_reads(lm_dir, steps, batch, 1, 1, window=window)[:, 0, 0]
    for e in range(2):
        assert sorted(want[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert want[:n].tolist() != want[n:2 * n].tolist()  # a new order each epoch
    for num_csx, workers in [(1, 2), (2, 1), (2, 2), (4, 1)]:
        got = worker_reads(lm_dir, steps, batch, num_csx, workers, window=window)[:, 0, 0]
        assert got.tolist() == want.tolist(), (num_csx, workers)
    for start in (1, 6, 7, 13):
        resumed = worker_reads(lm_dir, steps, batch, 2, 2, start=start, window=window)[:, 0, 0]
        assert resumed.tolist() == want[start * batch:].tolist(), start
    in_order = worker_reads(lm_dir, 7, batch, 2, 1, shuffle=False, window=window)[:, 0, 0]
    assert in_order.tolist() == [i % n for i in range(28)]


def test_shuffle_is_a_function_of_seed_and_epoch(lm_dir):
    def epochs(seed):
        stream = GlobalStream(lm_dir, shuffle=True, seed=seed, window=2)
        got = stream.read(0, 54)[:, 0, 0].tolist()
        stream.close()
        return got[:27], got[27:]

    a, b = epochs(1), epochs(1)
    assert a == b and sorted(a[0]) == list(range(27)) and a[0] != a[1] and a != epochs(2)


def test_shuffled_reads_whole_chunks_and_stay_random_within_a_window(tmp_path):
    """Chunks of many examples: a window's chunks come from all over the dataset, and inside a
    window consecutive examples are rarely consecutive in the files."""
    d = tmp_path / "big"
    d.mkdir()
    ex = np.zeros((4000, 3, 4096), np.int32)  # 48 KiB examples: 21 per 1 MiB chunk
    ex[:, 0, 0] = np.arange(4000)
    write_lm_file(d / "data-00000.h5", ex[:2000])
    write_lm_file(d / "data-00001.h5", ex[2000:])
    with h5py.File(d / "data-00000.h5") as f:
        assert f["data"].chunks == (21, 3, 4096)
    stream = GlobalStream(d, shuffle=True, seed=0, window=8)
    got = stream.read(0, 4000)[:, 0, 0]
    stream.close()
    assert sorted(got.tolist()) == list(range(4000))
    chunks = {(int(i) // 2000, int(i) % 2000 // 21) for i in got[:100]}  # inside the first window of 8 chunks
    assert 4 <= len(chunks) <= 8 and {f for f, _ in chunks} == {0, 1}
    assert np.mean(np.abs(np.diff(got)) == 1) < 0.05


def test_a_mixture_keeps_its_proportions(tmp_path):
    """Model Zoo's mixture: an epoch takes int(total * weight) examples of each directory (total
    sees every directory above 5% once), interleaved so every stretch holds the stated shares."""
    dirs = []
    for name, count, first in (("web", 100, 0), ("code", 40, 1000)):
        d = tmp_path / name
        d.mkdir()
        ex = np.zeros((count, 3, 4), np.int32)
        ex[:, 0, 0] = np.arange(first, first + count)
        write_lm_file(d / "data-00000.h5", ex)
        dirs.append(str(d))
    mixture = [{"data_dir": dirs[0], "weight": 0.75}, {"data_dir": dirs[1], "weight": 0.25}]
    stream = GlobalStream(mixture=mixture, shuffle=True, seed=5)
    assert stream.per_epoch == [120, 40] and stream.n == 160  # total = max(100 / .75, 40 / .25)
    got = stream.read(0, 3 * 160)[:, 0, 0]
    stream.close()
    web = got < 1000
    for e in range(3):
        assert int(web[e * 160:(e + 1) * 160].sum()) == 120
    assert set(got[:160][~web[:160]].tolist()) == set(range(1000, 1040))  # the smaller directory: once each
    assert set(got[:160][web[:160]].tolist()) == set(range(100))  # the larger: all, 20 of them twice
    shares = [web[i:i + 40].mean() for i in range(0, len(got), 40)]
    assert all(0.5 <= s <= 0.95 for s in shares), shares
    again = worker_reads(None, 30, 16, 2, 2, mixture=mixture, seed=5, window=64)[:, 0, 0]
    assert again.tolist() == got.tolist()
    with pytest.raises(DataError, match="every weight is 0"):
        GlobalStream(mixture=[{"data_dir": dirs[0], "weight": 0}])


def test_counts_come_from_data_params_and_a_changed_file_is_named(good):
    """Opening our dataset reads data_params.json only; a file that no longer matches it is named
    when first read (here: a file replaced by one with fewer examples)."""
    files = sorted(good.glob("*.h5"))
    ex = Dataset(good).read(0, 2)
    write_lm_file(files[0], ex[:2])
    ds = Dataset(good)  # opened, nothing read
    assert ds.counts[0] == 4
    with pytest.raises(DataError, match=r"data-00000.h5: holds 2 examples but data_params.json says 4"):
        ds.read(0, 3)


def test_a_damaged_chunk_is_named_by_the_loader(good):
    """The loader reads our chunks raw and checks their Fletcher-32 itself: a flipped byte is found
    and named by its chunk's examples, in order and shuffled."""
    path = sorted(good.glob("*.h5"))[1]
    damage_example(path, 2)
    for shuffle in (False, True):
        stream = GlobalStream(good, shuffle=shuffle)
        with pytest.raises(DataError, match=f"{path}: dataset 'data' unreadable at examples 0..3"):
            stream.read(0, stream.n)
        stream.close()


# --- errors: one clear line, non-zero exit, no traceback ------------------------------------------

def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for frag in fragments:
        assert frag in err[0], err[0]


def test_a_missing_relative_data_dir_says_where_it_was_looked_for_and_what_makes_the_demos(tmp_path):
    """The examples read wse_demo/data; run elsewhere, `wse fit` said only "no such dataset directory". A
    relative path is read from the current directory: the error says so with the absolute path looked
    at, and for the demo's directories that `wse demo` makes them."""
    import yaml

    example = Path(__file__).resolve().parents[1] / "examples" / "gpt2_small.yaml"
    fit = [sys.executable, "-m", "pyapi.cli", "fit", "--model_dir", str(tmp_path / "m")]
    demo = subprocess.run([*fit, str(example)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert_one_line_error(demo, f"wse fit: error: wse_demo/data: no such dataset directory (a relative path: looked "
                                f"for in the current directory, as {tmp_path / 'wse_demo' / 'data'}); `wse demo` "
                                "makes wse_demo/ in the directory it runs in")
    mine = yaml.safe_load(example.read_text())
    mine["train_input"]["data_dir"] = "mine"
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(mine))
    other = subprocess.run([*fit, "p.yaml"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert_one_line_error(other, f"mine: no such dataset directory (a relative path: looked for in the current "
                                 f"directory, as {tmp_path / 'mine'})")
    assert "wse demo" not in other.stderr


@pytest.fixture
def good(tmp_path, corpus):
    preprocess_text(corpus[0], tmp_path / "good", 32, samples_per_file=4, progress=False)
    return tmp_path / "good"


def test_verify_accepts_good_data_and_other_tools_files(good, tmp_path):
    assert wse("data", "verify", str(good)).returncode == 0
    other = tmp_path / "other"
    other.mkdir()
    ex = Dataset(good).read(0, 10)
    with h5py.File(other / "zoo.h5", "w") as f:  # contiguous, no checksum, no data_params.json
        f.create_dataset("data", data=ex)
        f.attrs["n_examples"] = 10
    assert wse("data", "verify", str(other)).returncode == 0


def damage_example(path, e):
    """Flip a byte of the chunk holding example ``e``: its checksum fails when it is read."""
    raw = bytearray(path.read_bytes())
    with h5py.File(path) as f:
        offset = f["data"].id.get_chunk_info_by_coord((e, 0, 0)).byte_offset
    raw[offset + 5] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_corrupt_byte(good):
    path = sorted(good.glob("*.h5"))[1]
    damage_example(path, 2)
    assert_one_line_error(wse("data", "verify", str(good)), path.name, "'data'", "examples")


def test_truncated_file(good):
    path = sorted(good.glob("*.h5"))[0]
    path.write_bytes(path.read_bytes()[:2000])
    assert_one_line_error(wse("data", "verify", str(good)), path.name, "not a readable HDF5 file")


def test_wrong_dtype_and_shape(tmp_path):
    for name, data, frag in [("dtype", np.zeros((2, 3, 8), np.int64), "dtype int64, expected int32"),
                             ("shape", np.zeros((2, 4, 8), np.int32), "shape (2, 4, 8)")]:
        d = tmp_path / name
        d.mkdir()
        with h5py.File(d / "x.h5", "w") as f:
            f["data"] = data
        assert_one_line_error(wse("data", "verify", str(d)), "x.h5", frag)


def test_id_above_vocab_and_bad_labels(good):
    path = sorted(good.glob("*.h5"))[2]
    with h5py.File(path, "r+") as f:
        d = f["data"]
        ex = d[1]
        ex[0, 3] = 300
        d[1] = ex
    assert_one_line_error(wse("data", "verify", str(good)), path.name, "example 1", "token id 300", "[0, 257)")
    with h5py.File(path, "r+") as f:
        ex = f["data"][1]
        ex[0, 3] = ex[2, 2]
        ex[2, 5] = (ex[2, 5] + 1) % 256
        f["data"][1] = ex
    assert_one_line_error(wse("data", "verify", str(good)), path.name, "example 1", "label at position 5")


def test_empty_inputs_and_missing_things(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert_one_line_error(wse("data", "preprocess", "--input", str(tmp_path / "empty.txt"), "--output_dir",
                              str(tmp_path / "o"), "--max_seq_length", "8"), "no text found")
    (tmp_path / "nodata").mkdir()
    assert_one_line_error(wse("data", "verify", str(tmp_path / "nodata")), "no .h5 files")
    assert_one_line_error(wse("data", "inspect", str(tmp_path / "nope")), "no such dataset directory")
    assert_one_line_error(wse("data", "preprocess", "--input", str(tmp_path / "missing.txt"), "--output_dir",
                              str(tmp_path / "o"), "--max_seq_length", "8"), "missing.txt", "no such file")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    assert_one_line_error(wse("data", "preprocess", "--input", str(tmp_path / "bad.jsonl"), "--output_dir",
                              str(tmp_path / "o"), "--max_seq_length", "8"), "bad.jsonl:2", "no 'text' field")
    assert_one_line_error(wse("data", "preprocess", "--input", str(tmp_path / "bad.jsonl"), "--output_dir",
                              str(tmp_path / "o"), "--max_seq_length", "8", "--tokenizer", "nope.json"),
                          "--tokenizer nope.json: no such file")


def test_refuses_to_overwrite_a_dataset(good, corpus):
    with pytest.raises(DataError, match="already holds a dataset"):
        preprocess_text(corpus[0], good, 32, progress=False)
    preprocess_text(corpus[0], good, 16, overwrite=True, progress=False)
    assert Dataset(good).example_shape == (3, 16)


def test_a_killed_preprocessing_worker_ends_the_run_with_one_line(tmp_path):
    """SIGKILL of a worker as soon as the workers exist (60 MB of text keep them busy for a second
    or more): one line naming the output and what to do, never a hang (multiprocessing.Pool waited
    forever for the task the dead worker held); the incomplete output is no dataset."""
    import os
    import signal
    import time

    letters = np.frombuffer(b"abcdefghij klmnopqrs tuvwxyz\n", np.uint8)
    rng = np.random.default_rng(0)
    for i in range(4):
        (tmp_path / f"in{i}.txt").write_bytes(letters[rng.integers(0, len(letters), 15 << 20)].tobytes())
    proc = subprocess.Popen([sys.executable, "-m", "pyapi.cli", "data", "preprocess", "--input", str(tmp_path),
                             "--output_dir", str(tmp_path / "out"), "--max_seq_length", "128", "--processes", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def forked():  # the workers: children with the parent's command line (not multiprocessing's helpers)
        proc_fs = Path("/proc")
        kids = []
        for d in filter(str.isdigit, os.listdir(proc_fs)):
            try:
                parent = int((proc_fs / d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == proc.pid and ((proc_fs / d / "cmdline").read_bytes()
                                           == (proc_fs / str(parent) / "cmdline").read_bytes()):
                    kids.append(int(d))
            except (OSError, IndexError):
                pass
        return kids

    deadline = time.monotonic() + 120
    try:
        while len(kids := forked()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        os.kill(kids[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)  # a hang fails here
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what a failure left
        except ProcessLookupError:
            pass
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"wse data: error: --output_dir {tmp_path / 'out'}: a worker process died "
                                        "(killed, or out of memory); the dataset there is incomplete (no "
                                        "data_params.json): run again with --overwrite"]
    with pytest.raises(DataError):
        Dataset(tmp_path / "out")


def test_cli_preprocess_inspect_json(tmp_path, corpus):
    out = tmp_path / "cli"
    proc = wse("data", "preprocess", "--input", *corpus[0], "--output-dir", str(out), "--max-seq-length", "32",
               "--processes", "2", "--compression", "lzf")
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "MB/s" in proc.stdout and "799" not in proc.stderr
    info = json.loads(wse("data", "inspect", str(out), "--json").stdout)
    assert info["max_seq_length"] == 32 and info["tokenizer"] == "byte"


def test_hugging_face_tokenizer(tmp_path, corpus):
    """A tokenizer.json (trained here, offline) tokenizes the corpus; ids stay below its vocabulary."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "[UNK]"])
    tok.train([p for p in corpus[0] if p.endswith(".txt")] + [str(f) for f in (tmp_path / "more").glob("*.txt")],
              trainer)
    tok.save(str(tmp_path / "tok.json"))
    params = preprocess_text(corpus[0], tmp_path / "hf", 16, tokenizer=str(tmp_path / "tok.json"),
                             processes=2, progress=False)
    assert params["vocab_size"] == tok.get_vocab_size() and params["eot_id"] == tok.token_to_id("<|endoftext|>")
    assert verify_dataset(tmp_path / "hf")["n_examples"] == params["n_examples"]
    first_doc = bytes(corpus[1][:list(corpus[1]).index(EOT)].astype(np.uint8)).decode("utf-8")
    decoded = inspect_dataset(tmp_path / "hf")["example_0_text"].strip()
    assert len(decoded) > 10 and first_doc.startswith(decoded)


def _lm_file(path, data):
    with h5py.File(path, "w") as f:
        if isinstance(data, str):
            f.create_group("data")
        else:
            f["data"] = data


BAD_LAYOUTS = {  # what the second of two files holds -> what the message says
    "a group named data": ("group", "'data' is a group, expected a dataset"),
    "2-D data": (np.zeros((4, 32), np.int32), "dataset 'data' has shape (4, 32), expected [n_examples, 3, max_seq_length]"),
    "float64 data": (np.zeros((4, 3, 32)), "dataset 'data' has dtype float64, expected int32"),
    "another sequence length": (np.zeros((4, 3, 16), np.int32), "dataset 'data' examples have shape (3, 16), other files (3, 32)"),
    "no data": (None, "no dataset 'data' (found: other)"),
}


@pytest.mark.parametrize("name", BAD_LAYOUTS)
def test_a_bad_layout_is_refused_before_anything_is_read(tmp_path, good, name):
    """Dataset (which `wse fit` and `wse validate` open before any rank starts) checks every file's
    layout, so no rank ever reads a group, a 2-D array or floats as token ids."""
    data, says = BAD_LAYOUTS[name]
    d = tmp_path / "bad"
    d.mkdir()
    (d / "a.h5").write_bytes(sorted(good.glob("*.h5"))[0].read_bytes())
    if data is None:
        with h5py.File(d / "b.h5", "w") as f:
            f["other"] = np.zeros(3)
    else:
        _lm_file(d / "b.h5", data)
    with pytest.raises(DataError) as err:
        Dataset(d)
    assert str(err.value) == f"{d / 'b.h5'}: {says}"
    assert_one_line_error(wse("data", "inspect", str(d)), f"{d / 'b.h5'}: {says}")
    params = {"train_input": {"data_dir": str(d), "batch_size": 2},
              "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 16, "num_hidden_layers": 1,
                        "num_heads": 2, "max_position_embeddings": 32},
              "optimizer": {"learning_rate": 1e-3},
              "runconfig": {"max_steps": 1, "model_dir": str(tmp_path / "model")}}
    (tmp_path / "p.yaml").write_text(json.dumps(params))
    assert_one_line_error(wse("fit", str(tmp_path / "p.yaml")), f"wse fit: error: {d / 'b.h5'}: {says}")
    assert not (tmp_path / "model").exists()


def test_array_layouts_are_checked_too(tmp_path):
    d = tmp_path / "arrays"
    d.mkdir()
    with h5py.File(d / "a.h5", "w") as f:
        f["features"] = np.zeros(4, np.float32)
        f["labels"] = np.zeros(4, np.int32)
    with pytest.raises(DataError, match=r"a.h5: dataset 'features' is float32 \(4,\), expected numbers \[n, \.\.\.\]"):
        Dataset(d)


def test_inspect_and_read_name_a_damaged_file(good):
    path = sorted(good.glob("*.h5"))[0]
    damage_example(path, 0)
    assert_one_line_error(wse("data", "inspect", str(good)), f"{path}: dataset 'data' unreadable at examples 0..0")
    with pytest.raises(DataError, match=f"{path}: dataset 'data' unreadable at examples 0..1"):
        Dataset(good).read(0, 2)


# --- Model Zoo's files and metadata -----------------------------------------------------------------

def modelzoo_dir(path, *, vocab=50, seq=16, pad=0, eos=2, tokenizer="gpt2", n=12):
    """A directory as Model Zoo's preprocessing writes it: nested data_params.json; pad_id != eos_id;
    sequences packed to max_seq_length, and short ones (short_seq_prob) padded with pad_id; gzip,
    one example per chunk, no checksum."""
    rng = np.random.default_rng(4)
    path.mkdir()
    ex = np.full((n, 3, seq), pad, np.int32)
    for i in range(n):
        k = seq if i % 3 else int(rng.integers(3, seq - 2))  # every third example is short
        toks = rng.integers(3, vocab, k + 1)
        toks[-1] = eos
        ex[i, 0, :k], ex[i, 2, :k], ex[i, 1, :k] = toks[:-1], toks[1:], 1
    with h5py.File(path / "data-0.h5", "w") as f:
        f.create_dataset("data", data=ex, chunks=(1, 3, seq), compression="gzip")
        f.attrs["n_examples"] = n
    (path / "data_params.json").write_text(json.dumps({
        "setup": {"input_dir": "./raw", "output_dir": str(path), "processes": 1, "mode": "pretraining"},
        "processing": {"huggingface_tokenizer": tokenizer, "max_seq_length": seq, "pad_id": pad, "eos_id": eos,
                       "vocab_size": vocab, "short_seq_prob": 0.33, "write_in_batch": True},
        "dataset": {"use_ftfy": True, "pack_sequences": True},
        "post-process": {"n_examples": n, "num_tokens": int(ex[:, 1].sum()), "discarded_files": 0},
        "features": ["input_ids", "attention_mask", "labels"]}))
    return ex


def test_modelzoo_files_verify_with_pad_not_eos_and_short_sequences(tmp_path):
    """The last label of a sequence is not an input (the pad follows it): verify does not mistake
    that for a wrong label, and still catches a label that is wrong."""
    ex = modelzoo_dir(tmp_path / "mz")
    assert verify_dataset(tmp_path / "mz") == {"format": "lm", "files": 1, "n_examples": 12}
    bad = tmp_path / "bad"
    ex[4, 2, 5] = (ex[4, 0, 6] + 1) % 50
    modelzoo_dir(bad)
    with h5py.File(bad / "data-0.h5", "r+") as f:
        f["data"][4] = ex[4]
    with pytest.raises(DataError, match="example 4: label at position 5"):
        verify_dataset(bad)


def test_nested_data_params_are_read(tmp_path):
    modelzoo_dir(tmp_path / "mz", tokenizer=str(tmp_path / "hub"))
    meta = read_meta(tmp_path / "mz")
    assert {k: meta[k] for k in ("vocab_size", "pad_id", "eos_id", "max_seq_length", "short_seq_prob",
                                 "n_examples")} == {"vocab_size": 50, "pad_id": 0, "eos_id": 2,
                                                    "max_seq_length": 16, "short_seq_prob": 0.33, "n_examples": 12}
    info = inspect_dataset(tmp_path / "mz")
    assert info["vocab_size"] == 50 and info["pad_id"] == 0 and info["eos_id"] == 2
    assert "cannot decode" in info["example_0_text"] and "hub" in info["example_0_text"]


def test_inspect_decodes_with_the_datasets_own_tokenizer(tmp_path, corpus):
    """A Model Zoo directory naming a tokenizer directory (a Hugging Face model's) is decoded with it."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    tok.train([str(tmp_path / "a.txt")], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet))
    (tmp_path / "hf-model").mkdir()
    tok.save(str(tmp_path / "hf-model" / "tokenizer.json"))
    preprocess_text([str(tmp_path / "a.txt")], tmp_path / "ours", 16, tokenizer=str(tmp_path / "hf-model"),
                    progress=False)
    ours = inspect_dataset(tmp_path / "ours")
    assert ours["example_0_text"] == tok.decode(ours["example_0_ids"][:16])
    modelzoo_dir(tmp_path / "mz", vocab=tok.get_vocab_size(), tokenizer=str(tmp_path / "hf-model"))
    info = inspect_dataset(tmp_path / "mz")
    assert info["example_0_text"] == tok.decode(info["example_0_ids"]) and "cannot" not in info["example_0_text"]


def test_a_vocabulary_larger_than_the_models_is_refused_before_launch(tmp_path):
    modelzoo_dir(tmp_path / "mz", vocab=50)
    params = {"train_input": {"data_dir": str(tmp_path / "mz"), "batch_size": 2},
              "model": {"name": "gpt2", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 1,
                        "num_heads": 2, "max_position_embeddings": 16},
              "optimizer": {"learning_rate": 1e-3},
              "runconfig": {"max_steps": 1, "model_dir": str(tmp_path / "model")}}
    (tmp_path / "p.yaml").write_text(json.dumps(params))
    assert_one_line_error(wse("fit", str(tmp_path / "p.yaml")), "model.vocab_size: 40 is smaller than the vocabulary 50",
                          str(tmp_path / "mz"))
    assert not (tmp_path / "model").exists()


def test_jsonl_jobs_cut_at_any_byte_give_the_same_dataset(tmp_path, corpus, monkeypatch):
    """Jobs take the .jsonl lines that start in their byte range: cutting the inputs into many
    small jobs changes nothing in the output; an error names the line in the whole file."""
    import data_tools.preprocess as pp
    from data_tools.documents import discover_inputs

    inputs, stream = corpus
    whole = preprocess_text(inputs, tmp_path / "whole", 32, progress=False)
    monkeypatch.setattr(pp, "JOB_BYTES", 97)
    assert len(pp.plan_jobs(discover_inputs(inputs))) > 10
    cut = preprocess_text(inputs, tmp_path / "cut", 32, processes=2, progress=False)
    assert cut["n_tokens"] == whole["n_tokens"] == len(stream)
    for shard in whole["files"]:
        assert (tmp_path / "whole" / shard["name"]).read_bytes() == (tmp_path / "cut" / shard["name"]).read_bytes()
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(30)]
    lines[23] = '{"text": broken'
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"big.jsonl:24: not valid JSON"):
        preprocess_text([str(tmp_path / "big.jsonl")], tmp_path / "o", 8, progress=False)


def test_progress_says_rate_and_time_left(tmp_path, corpus):
    import io

    from data_tools.preprocess import Progress

    out = io.StringIO()
    bar = Progress(10_000_000, stream=out)
    bar.last = -1e9
    bar.t0 -= 2.0
    bar.update(4_000_000, 1234)
    line = out.getvalue()
    assert "4.0/10.0 MB" in line and "1,234 tokens" in line and "MB/s" in line and "ETA 0:0" in line


def _fletcher32_reference(data):
    """HDF5's H5_checksum_fletcher32, word by word as HDF5 writes it."""
    s1 = s2 = 0
    words, i = len(data) // 2, 0
    while words:
        t = min(words, 360)
        words -= t
        for _ in range(t):
            s1 = (s1 + ((data[i] << 8) | data[i + 1])) & 0xFFFFFFFF
            s2 = (s2 + s1) & 0xFFFFFFFF
            i += 2
        s1, s2 = (s1 & 0xFFFF) + (s1 >> 16), (s2 & 0xFFFF) + (s2 >> 16)
    if len(data) % 2:
        s1 = (s1 + (data[i] << 8)) & 0xFFFFFFFF
        s2 = (s2 + s1) & 0xFFFFFFFF
        s1, s2 = (s1 & 0xFFFF) + (s1 >> 16), (s2 & 0xFFFF) + (s2 >> 16)
    s1, s2 = (s1 & 0xFFFF) + (s1 >> 16), (s2 & 0xFFFF) + (s2 >> 16)
    return (s2 << 16) | s1


def test_our_fletcher32_is_hdf5s(tmp_path):
    """The loader's checksum kernel gives HDF5's value bit for bit: against a word-by-word
    reference (odd lengths, all-ones words that wrap the sums) and against the checksums HDF5
    stored in chunks it wrote, of even and odd byte lengths; a flipped bit fails."""
    from wse_core.data import chunk_ok, fletcher32

    rng = np.random.default_rng(2)
    for n in (0, 1, 2, 3, 719, 720, 721, 5001, 100_003):
        for data in (rng.integers(0, 256, n, dtype=np.uint8), np.full(n, 255, np.uint8)):
            assert fletcher32(data) == _fletcher32_reference(bytes(data)), n
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_dataset("even", data=rng.integers(0, 2**31, (64, 3, 40), dtype=np.int32), chunks=(21, 3, 40),
                         fletcher32=True)
        f.create_dataset("odd", data=rng.integers(0, 256, 1001, dtype=np.uint8), chunks=(77,), fletcher32=True)
    with h5py.File(tmp_path / "f.h5") as f:
        for name in ("even", "odd"):
            d = f[name]
            size = int(np.prod(d.chunks)) * d.dtype.itemsize
            for lo in range(0, d.shape[0], d.chunks[0]):
                _, raw = d.id.read_direct_chunk((lo,) + (0,) * (d.ndim - 1))
                buf = np.frombuffer(raw, np.uint8).copy()
                assert len(buf) == size + 4 and chunk_ok(buf, 0, size), (name, lo)
                buf[lo % size] ^= 1
                assert not chunk_ok(buf, 0, size)
    with pytest.raises(ValueError, match="outside a buffer"):
        chunk_ok(np.zeros(8, np.uint8), 2, 4)


def test_a_file_another_process_reads_is_replaced_whole(tmp_path):
    """data_tools.files: a reader finds the old file or the new one; a write that fails leaves the old
    one and no temporary file."""
    from data_tools.files import replacing, write_text

    path = tmp_path / "plan.json"
    write_text(path, "old")
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            tmp.write_text("half of the ne")
            assert path.read_text() == "old"  # until the block ends
            raise RuntimeError("the writer died")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    write_text(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
