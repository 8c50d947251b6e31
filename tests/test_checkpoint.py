"""The sharded checkpoint store: round trip, resharding, damage detection and crash safety."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from data_tools.checkpoint import Checkpoint, clean_up, recover_latest, save_checkpoint
from data_tools.errors import CheckpointError
from wse_core.models import build_model
from wse_core.optim import AdamW

GPT2 = {"name": "gpt2", "vocab_size": 61, "hidden_size": 16, "num_hidden_layers": 3, "num_heads": 2,
        "max_position_embeddings": 8}


def wse(*args):
    return subprocess.run([sys.executable, "-m", "pyapi.cli", *args], capture_output=True, text=True, timeout=120)


def model_state(seed=0):
    model = build_model(GPT2)
    params = model.init_params(seed)
    opt = AdamW()
    state = {k: opt.init_state(v) for k, v in params.items()}
    for k in state:  # non-zero optimizer state, so a mix-up would show
        state[k]["exp_avg"][...] = params[k] * 0.5
        state[k]["exp_avg_sq"][...] = params[k] ** 2
    return model, params, state


def split(names, parts):
    """Names in order, cut into `parts` contiguous groups (as MemoryX ranks own layers)."""
    bounds = np.linspace(0, len(names), parts + 1).astype(int)
    return [names[bounds[i]:bounds[i + 1]] for i in range(parts)]


def save(model_dir, step, params, state, shards=2):
    groups = split(list(params), shards)
    return save_checkpoint(model_dir, step, [({n: params[n] for n in g}, {n: state[n] for n in g}) for g in groups],
                           params_yaml="model:\n  name: gpt2\n", loader_state={"epoch": 1, "index": 7},
                           rng_state={"seed": 3})


def assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


@pytest.mark.parametrize("load_shards", [1, 2, 3])
def test_round_trip_and_reshard(tmp_path, load_shards):
    """Written by 2 MemoryX shards, loaded back whole or into 1, 2 or 3 groups, bit for bit."""
    model, params, state = model_state()
    path = save(tmp_path, 10, params, state, shards=2)
    ckpt = Checkpoint(tmp_path)                      # resolves model_dir/latest
    assert ckpt.dir == path and ckpt.step == 10 and ckpt.num_shards == 2
    assert ckpt.param_names == model.param_names
    assert ckpt.loader_state == {"epoch": 1, "index": 7} and ckpt.rng_state == {"seed": 3}
    loaded_p, loaded_s = {}, {}
    for group in split(model.param_names, load_shards):
        p, s = ckpt.load(group)
        loaded_p.update(p)
        loaded_s.update(s)
    assert_same(loaded_p, params)
    for k in params:
        assert_same(loaded_s[k], state[k])


def test_index_shows_every_tensor_through_external_links(tmp_path):
    _, params, state = model_state()
    path = save(tmp_path, 1, params, state)
    with h5py.File(path / "index.h5") as f:
        np.testing.assert_array_equal(f["model/blocks.2.mlp.fc.weight"][()], params["blocks.2.mlp.fc.weight"])
        np.testing.assert_array_equal(f["optimizer/wte.weight/exp_avg_sq"][()], state["wte.weight"]["exp_avg_sq"])


def test_latest_follows_the_newest_and_resave_replaces(tmp_path):
    _, p0, s0 = model_state(0)
    _, p1, s1 = model_state(1)
    save(tmp_path, 1, p0, s0)
    save(tmp_path, 2, p1, s1)
    assert (tmp_path / "latest").read_text().strip() == "checkpoint_2"
    save(tmp_path, 2, p0, s0)
    assert_same(Checkpoint(tmp_path).load()[0], p0)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["checkpoint_1", "checkpoint_2", "latest"]


def verdicts(model_dir):
    """What ``verify`` and ``load`` say about a checkpoint (None: all is well), and ``wse checkpoint verify``."""
    said = []
    for check in (lambda c: c.verify(), lambda c: c.load()):
        try:
            check(Checkpoint(model_dir))
            said.append(None)
        except CheckpointError as exc:
            said.append(str(exc))
    proc = wse("checkpoint", "verify", str(model_dir))
    return said, proc


def set_attr(key, value):
    def damage(path):
        with h5py.File(path / "index.h5", "r+") as f:
            f.attrs[key] = value(f.attrs[key])
    return damage


def edit_json_attr(key, edit):
    def change(text):
        table = json.loads(text)
        edit(table)
        return json.dumps(table)
    return set_attr(key, change)


def first_tensor_sha(table):
    key = next(iter(table))
    table[key]["sha256"] = "0" * 64


def retarget_link(path):
    with h5py.File(path / "index.h5", "r+") as f:
        del f["model/wte.weight"]
        f["model/wte.weight"] = h5py.ExternalLink("memoryx_1.h5", "/model/wte.weight")


def flip_tensor_byte(path):
    shard = path / "memoryx_1.h5"
    with h5py.File(shard) as f:
        offset = f["model/blocks.2.attn.qkv.weight"].id.get_offset()
    raw = bytearray(shard.read_bytes())
    raw[offset + 17] ^= 0x40
    shard.write_bytes(bytes(raw))


def truncate(name):
    def damage(path):
        (path / name).write_bytes((path / name).read_bytes()[:1000])
    return damage


DAMAGE = {  # what is done to checkpoint_4 -> the file named, and what the message says
    "step 4 -> 5": (set_attr("step", lambda v: v + 1), "index.h5", "the index is damaged"),
    "a tensor's SHA-256 entry": (edit_json_attr("tensors", first_tensor_sha), "index.h5", "the index is damaged"),
    "a shard's SHA-256 entry": (edit_json_attr("shard_sha256", lambda t: t.update({"memoryx_0.h5": "0" * 64})),
                                "index.h5", "the index is damaged"),
    "the loader position": (edit_json_attr("loader_state", lambda t: t.update(index=8)), "index.h5",
                            "the index is damaged"),
    "metadata_sha256 itself": (set_attr("metadata_sha256", lambda v: "0" * 64), "index.h5", "the index is damaged"),
    "a link to another shard": (retarget_link, "index.h5", "link /model/wte.weight does not point to memoryx_0.h5"),
    "truncated index": (truncate("index.h5"), "index.h5", "not a readable HDF5 file"),
    "a byte of tensor data": (flip_tensor_byte, "memoryx_1.h5", "tensor model/blocks.2.attn.qkv.weight is damaged"),
    "bytes after the HDF5 data": (lambda p: open(p / "memoryx_1.h5", "ab").write(b"x"), "memoryx_1.h5",
                                  "outside tensor data (HDF5 metadata is damaged)"),
    "truncated shard": (truncate("memoryx_0.h5"), "memoryx_0.h5", "not a readable HDF5 file"),
    "missing shard": (lambda p: (p / "memoryx_0.h5").unlink(), "memoryx_0.h5", "missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_verify_and_load_name_the_damaged_file_alike(tmp_path, damage):
    """Whatever is damaged, verify and load refuse with the same message, which names the damaged
    file; the index protects its own metadata (a changed step would otherwise resume elsewhere)."""
    _, params, state = model_state()
    path = save(tmp_path, 4, params, state)
    assert verdicts(tmp_path)[0] == [None, None]
    do, name, says = DAMAGE[damage]
    do(path)
    (verify_says, load_says), proc = verdicts(tmp_path)
    assert verify_says == load_says, (verify_says, load_says)
    assert verify_says.startswith(f"{path / name}: ") and says in verify_says, verify_says
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [f"wse checkpoint: error: {verify_says}"]


def test_a_damaged_shard_fails_every_load_from_it_and_no_other(tmp_path):
    _, params, state = model_state()
    path = save(tmp_path, 5, params, state)
    flip_tensor_byte(path)
    with pytest.raises(CheckpointError, match="memoryx_1.h5: tensor model/blocks.2.attn.qkv.weight is damaged"):
        Checkpoint(path).load(["blocks.2.mlp.fc.weight"])  # intact, but in the damaged shard
    first = split(list(params), 2)[0]
    Checkpoint(path).load(first)  # the other shard's tensors still load


def test_format_1_checkpoints_still_load(tmp_path):
    """Written before the index protected itself: loaded, each shard and tensor still checked."""
    _, params, state = model_state()
    path = save(tmp_path, 2, params, state)
    with h5py.File(path / "index.h5", "r+") as f:
        del f.attrs["metadata_sha256"]
        f.attrs["format_version"] = 1
    assert_same(Checkpoint(tmp_path).load()[0], params)
    with h5py.File(path / "index.h5", "r+") as f:
        f.attrs["format_version"] = 3
    with pytest.raises(CheckpointError, match="format version 3 is newer"):
        Checkpoint(tmp_path)


def test_truncated_shard_and_missing_things(tmp_path):
    _, params, state = model_state()
    path = save(tmp_path, 5, params, state)
    proc = wse("checkpoint", "info", str(tmp_path / "nothing"))
    assert proc.returncode == 1 and "no such checkpoint or model directory" in proc.stderr
    with pytest.raises(CheckpointError, match="no parameter 'nope'"):
        Checkpoint(path).load(["nope"])
    (tmp_path / "latest").write_text("checkpoint_9\n")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'latest'}: names 'checkpoint_9', which has no index.h5"):
        Checkpoint(tmp_path)


def test_a_lost_latest_is_recovered_from_the_newest_complete_checkpoint_or_refused(tmp_path):
    """`latest` missing (or unreadable) beside checkpoints: `wse fit` started afresh over them. A run
    recovers it (``recover_latest``: the newest checkpoint that verifies, said in one line, ``latest``
    written again); info and verify point at that checkpoint; with none complete, one line."""
    _, params, state = model_state()
    for step in (1, 2, 3):
        save(tmp_path, step, params, state)
    (tmp_path / "latest").unlink()
    (tmp_path / "checkpoint_3" / "memoryx_0.h5").unlink()  # the newest is not complete
    for action in ("info", "verify"):
        proc = wse("checkpoint", action, str(tmp_path))
        assert proc.returncode == 1 and proc.stderr.splitlines() == [
            f"wse checkpoint: error: {tmp_path}: latest is missing; the newest complete checkpoint is checkpoint_2 "
            f"(`wse fit` resumes from it and writes latest again; to read it now, give {tmp_path / 'checkpoint_2'})"]
    (tmp_path / "latest").write_bytes(b"\xff\x00\n")  # a damaged disk's
    with pytest.raises(CheckpointError, match=r": latest is unreadable \(not UTF-8 text\); the newest complete "):
        Checkpoint(tmp_path)
    where, said = recover_latest(tmp_path)
    assert where == tmp_path / "checkpoint_2" and said == (
        "latest was unreadable (not UTF-8 text): resuming from checkpoint_2 (step 2), the newest complete one; newer "
        f"ones are not complete: {tmp_path / 'checkpoint_3' / 'memoryx_0.h5'}: missing")
    assert (tmp_path / "latest").read_text() == "checkpoint_2\n" and Checkpoint(tmp_path).step == 2
    assert recover_latest(tmp_path) == (tmp_path, None)  # latest is sound again: nothing to say
    shutil.rmtree(tmp_path / "checkpoint_1")
    shutil.rmtree(tmp_path / "checkpoint_2")
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tmp_path}: latest is missing and no checkpoint in it is complete (the newest: "
            f"{tmp_path / 'checkpoint_3' / 'memoryx_0.h5'}: missing); move them away to start afresh")):
        recover_latest(tmp_path)
    shutil.rmtree(tmp_path / "checkpoint_3")
    assert recover_latest(tmp_path) == (None, None)  # nothing there: a first run


def test_killed_writer_leaves_latest_intact(tmp_path):
    """SIGKILL half-way through writing checkpoint 2: latest still names checkpoint 1, which loads and verifies."""
    _, params, state = model_state()
    save(tmp_path, 1, params, state)
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import model_state
        from data_tools.checkpoint import CheckpointWriter
        _, params, state = model_state(1)
        w = CheckpointWriter({str(tmp_path)!r}, 2).prepare()
        w.write_shard(0, params, state)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / ".checkpoint_2.partial").exists()
    assert (tmp_path / "latest").read_text().strip() == "checkpoint_1"
    ckpt = Checkpoint(tmp_path)
    ckpt.verify()
    assert_same(ckpt.load()[0], params)
    _, p2, s2 = model_state(2)
    save(tmp_path, 2, p2, s2)                       # the next save clears the debris
    assert not (tmp_path / ".checkpoint_2.partial").exists()
    assert_same(Checkpoint(tmp_path).load()[0], p2)


@pytest.mark.parametrize("killed", ["between the renames", "before removing the old copy"])
def test_a_resave_killed_midway_leaves_a_loadable_checkpoint(tmp_path, killed):
    """Re-saving checkpoint_2 moves the old copy aside, moves the new one in, removes the old: a
    writer killed in between leaves ``latest`` naming a checkpoint that loads, and the next job's
    clean_up leaves exactly one checkpoint_2."""
    _, p0, s0 = model_state(0)
    save(tmp_path, 2, p0, s0)
    script = textwrap.dedent(f"""
        import os, shutil, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import model_state, save
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        if {killed!r} == "between the renames":
            real = os.rename
            os.rename = lambda src, dst: die() if str(src).endswith(".partial") else real(src, dst)
        else:
            real = shutil.rmtree
            shutil.rmtree = lambda path, **kw: die() if os.path.isdir(path) and str(path).endswith(".old") else real(path, **kw)
        _, p1, s1 = model_state(1)
        save({str(tmp_path)!r}, 2, p1, s1)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / ".checkpoint_2.old").is_dir()
    _, p1, _ = model_state(1)
    committed = p0 if killed == "between the renames" else p1
    ckpt = Checkpoint(tmp_path)
    ckpt.verify()
    assert_same(ckpt.load()[0], committed)
    clean_up(tmp_path)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["checkpoint_2", "latest"]
    assert_same(Checkpoint(tmp_path).load()[0], committed)


def test_a_full_disk_names_the_file_keeps_the_last_checkpoint_and_leaks_nothing(tmp_path, small_disk):
    _, params, state = model_state()
    one = sum(f.stat().st_size for f in save(tmp_path / "measure", 1, params, state).iterdir())
    disk = small_disk(int(2.5 * one))
    save(disk, 1, params, state)
    save(disk, 2, params, state)
    with pytest.raises(CheckpointError) as err:
        save(disk, 3, params, state)
    said = str(err.value)
    assert re.match(rf"{disk}/\.checkpoint_3\.partial/(memoryx_\d\.h5|index\.h5): No space left on device "
                    r"while writing a checkpoint; it was not saved \(checkpoint_2 is intact\)$", said), said
    ckpt = Checkpoint(disk)
    assert ckpt.step == 2
    ckpt.verify()
    assert_same(ckpt.load()[0], params)
    (disk / "checkpoint_1" / "memoryx_0.h5").unlink()  # the user makes room (and loses checkpoint_1)
    shutil.rmtree(disk / "checkpoint_1")
    save(disk, 4, params, state)  # what the failed save left is gone, so this one fits
    assert sorted(x.name for x in disk.iterdir()) == ["checkpoint_2", "checkpoint_4", "latest"]


def test_cli_info_and_convert(tmp_path):
    model, params, state = model_state()
    save(tmp_path, 3, params, state)
    proc = wse("checkpoint", "info", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["step"] == 3 and info["num_shards"] == 2 and info["n_params"] == model.num_params()
    assert info["optimizer_states"] == ["exp_avg", "exp_avg_sq"]
    assert wse("checkpoint", "verify", str(tmp_path)).returncode == 0
    assert wse("checkpoint", "convert", str(tmp_path), "--to", "npz", "--output", str(tmp_path / "w.npz")).returncode == 0
    with np.load(tmp_path / "w.npz") as z:
        assert_same({k: z[k] for k in z.files}, params)
    assert wse("checkpoint", "convert", str(tmp_path), "--to", "h5", "--output", str(tmp_path / "w.h5")).returncode == 0
    with h5py.File(tmp_path / "w.h5") as f:
        assert_same({k: f[k][()] for k in f}, params)
    proc = wse("checkpoint", "convert", str(tmp_path), "--to", "torch", "--output", str(tmp_path / "w.pt"))
    try:
        import torch
    except ImportError:
        assert proc.returncode == 1 and "PyTorch is not installed" in proc.stderr
    else:
        assert proc.returncode == 0
        sd = torch.load(tmp_path / "w.pt")
        assert_same({k: v.numpy() for k, v in sd.items()}, params)


def test_info_and_verify_count_the_same_tensors_and_say_which(tmp_path):
    """`info` said 52 tensors and `verify` 156 of the same checkpoint: each now says both, the parameters'
    and all of them with the optimizer's state, and a count of one is singular."""
    model, params, state = model_state()
    save(tmp_path, 3, params, state, shards=1)
    n, in_all = len(model.param_names), 3 * len(model.param_names)  # each with exp_avg and exp_avg_sq
    info = json.loads(wse("checkpoint", "info", str(tmp_path), "--json").stdout)
    assert info["n_tensors"] == n and info["n_tensors_in_all"] == in_all
    said = f"{n} tensors ({in_all} in all, with the optimizer's state)"
    lines = wse("checkpoint", "info", str(tmp_path)).stdout.splitlines()
    assert [line.split(None, 1)[1] for line in lines if line.startswith("n_tensors ")] == [said]
    verified = wse("checkpoint", "verify", str(tmp_path)).stdout
    assert verified == f"{tmp_path / 'checkpoint_3'}: ok (step 3, 1 shard, {said})\n"


def test_validate_names_the_tensor_whose_shape_the_params_model_does_not_have(tmp_path):
    """`wse validate` after a shape-changing --set blamed eval_input.data_dir ("cannot reshape array"):
    it checks the checkpoint against the params' model as `wse fit` does (one rule,
    ``Checkpoint.check_model``), naming the tensor and both shapes. A run directory stands for its
    params.yaml."""
    import yaml

    from data_tools.preprocess import preprocess_text

    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    preprocess_text([tmp_path / "a.txt"], tmp_path / "data", 8, progress=False)
    cfg = dict(GPT2, vocab_size=257)
    model = build_model(cfg)
    save_checkpoint(tmp_path / "run", 3, [(model.init_params(0), {})])
    p = {"train_input": {"data_dir": str(tmp_path / "data"), "batch_size": 4},
         "eval_input": {"data_dir": str(tmp_path / "data"), "batch_size": 4}, "model": cfg,
         "optimizer": {"learning_rate": 1e-3}, "runconfig": {"max_steps": 3, "model_dir": str(tmp_path / "run")}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(p))
    assert wse("validate", str(tmp_path / "p.yaml"), "--eval_steps", "1").returncode == 0
    wider = wse("validate", str(tmp_path / "p.yaml"), "--set", "model.hidden_size=32")
    ckpt = tmp_path / "run" / "checkpoint_3"
    assert wider.returncode == 1 and wider.stderr.splitlines()[-1] == (
        f"wse validate: error: {ckpt}: parameter 'wte.weight' has shape [257, 16], this model's is [257, 32] "
        "(the params' model is not the one that wrote it)")
    deeper = wse("validate", str(tmp_path / "p.yaml"), "--set", "model.num_hidden_layers=4")
    assert deeper.returncode == 1 and deeper.stderr.splitlines()[-1].endswith(
        f"{ckpt}: does not hold parameter 'blocks.3.attn.proj.bias' of this model")
    with pytest.raises(CheckpointError, match=r"parameter 'wte.weight' has shape \[257, 16\], this model's is "):
        Checkpoint(tmp_path / "run").check_model(build_model(dict(cfg, hidden_size=32)))
    (tmp_path / "run" / "params.yaml").write_text(yaml.safe_dump(p))  # as a run writes it
    assert wse("validate", str(tmp_path / "run"), "--eval_steps", "1").returncode == 0
