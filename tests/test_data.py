"""Dataset preprocessing, verification and the loader, with the errors a user meets."""
import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from data_tools.dataset import Dataset, GlobalStream, Loader, inspect_dataset
from data_tools.errors import DataError
from data_tools.lmdata import verify_dataset, write_lm_file
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
    loader = Loader(tmp_path / "out", batch_size=ds.n_examples)
    batch = loader.next_batch()
    loader.close()
    got = np.stack([batch["input_ids"], batch["loss_mask"], batch["labels"]], axis=1)
    np.testing.assert_array_equal(unpack(got), stream)
    with h5py.File(ds.files[0]) as f:
        assert f.attrs["n_examples"] == 7 and f["data"].chunks == (1, 3, 64) and f["data"].fletcher32


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
    with Loader(tmp_path / "arr", 50) as loader:
        b = loader.next_batch()
    np.testing.assert_array_equal(b["features"], x)
    np.testing.assert_array_equal(b["labels"], y)


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


def test_workers_split_files_and_cover_everything(lm_dir):
    seen = []
    for w in range(2):
        with Loader(lm_dir, 3, worker_id=w, num_workers=2) as loader:
            got = sum((ids(loader.next_batch()) for _ in range(loader.n_local // 3)), [])
        files = [Dataset(lm_dir).files[i] for i in range(w, 5, 2)]
        assert loader.files == files
        seen += got
    assert sorted(seen) == list(range(27))


def test_shuffle_is_a_function_of_seed_and_epoch(lm_dir):
    def epochs(seed):
        with Loader(lm_dir, 9, shuffle=True, seed=seed) as loader:
            return [ids(loader.next_batch()) + ids(loader.next_batch()) + ids(loader.next_batch()) for _ in range(2)]

    a, b = epochs(1), epochs(1)
    assert a == b and sorted(a[0]) == list(range(27)) and a[0] != a[1] and a != epochs(2)


def test_batches_span_epochs_and_resume_exactly(lm_dir):
    with Loader(lm_dir, 5, shuffle=True, seed=3) as loader:
        first = [ids(loader.next_batch()) for _ in range(7)]   # 35 examples: into epoch 1
        pos = loader.position
        rest = [ids(loader.next_batch()) for _ in range(4)]
    assert pos == {"epoch": 1, "index": 8}
    with Loader(lm_dir, 5, shuffle=True, seed=3, position=pos) as resumed:
        assert [ids(resumed.next_batch()) for _ in range(4)] == rest
    assert sorted(sum(first, [])[:27]) == list(range(27))


# --- errors: one clear line, non-zero exit, no traceback ------------------------------------------

def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for frag in fragments:
        assert frag in err[0], err[0]


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
    """Flip a byte of example ``e``'s chunk: its checksum fails when it is read."""
    raw = bytearray(path.read_bytes())
    with h5py.File(path) as f:
        offset = f["data"].id.get_chunk_info(e).byte_offset
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
