"""The sharded checkpoint store: round trip, resharding, damage detection and crash safety."""
import os
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from data_tools.checkpoint import Checkpoint, save_checkpoint
from data_tools.errors import CheckpointError
from wse_core.nn import build_model
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


def test_flipped_byte_is_caught_by_verify_and_load(tmp_path):
    _, params, state = model_state()
    path = save(tmp_path, 5, params, state)
    shard = path / "memoryx_1.h5"
    name = "blocks.2.attn.qkv.weight"
    with h5py.File(shard) as f:
        offset = f[f"model/{name}"].id.get_offset()
    raw = bytearray(shard.read_bytes())
    raw[offset + 17] ^= 0x40
    shard.write_bytes(bytes(raw))
    proc = wse("checkpoint", "verify", str(path))
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert "memoryx_1.h5" in proc.stderr and f"model/{name}" in proc.stderr and "damaged" in proc.stderr
    with pytest.raises(CheckpointError, match=f"memoryx_1.h5: tensor model/{name} is damaged"):
        Checkpoint(path).load()
    Checkpoint(path).load([n for n in params if n != name])  # the undamaged tensors still load


def test_truncated_shard_and_missing_things(tmp_path):
    _, params, state = model_state()
    path = save(tmp_path, 5, params, state)
    (path / "memoryx_0.h5").write_bytes((path / "memoryx_0.h5").read_bytes()[:1000])
    proc = wse("checkpoint", "verify", str(tmp_path))
    assert proc.returncode == 1 and "memoryx_0.h5" in proc.stderr and "Traceback" not in proc.stderr
    proc = wse("checkpoint", "info", str(tmp_path / "nothing"))
    assert proc.returncode == 1 and "no such checkpoint or model directory" in proc.stderr
    with pytest.raises(CheckpointError, match="no parameter 'nope'"):
        Checkpoint(path).load(["nope"])


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


def test_cli_info_and_convert(tmp_path):
    model, params, state = model_state()
    save(tmp_path, 3, params, state)
    proc = wse("checkpoint", "info", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    import json

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
