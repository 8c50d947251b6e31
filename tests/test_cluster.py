"""The weight-streaming cluster under `wse fit`: exactness against the reference step, resume, failures."""
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import yaml

from data_tools.checkpoint import Checkpoint
from data_tools.dataset import GlobalStream
from data_tools.preprocess import preprocess_text
from wse_core.nn import build_model, numpy_ops, reference_step
from wse_core.optim import make_optimizer, make_schedule

STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    preprocess_text(["stdlib"], d / "lm", 32, samples_per_file=64, progress=False)
    return d / "lm"


def params_file(tmp_path, data, **runconfig):
    p = {
        "train_input": {"data_dir": str(data), "batch_size": 8, "micro_batch_size": 2, "shuffle": True,
                        "shuffle_seed": 4},
        "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
                  "max_position_embeddings": 32},
        "optimizer": {"optimizer_type": "AdamW", "weight_decay": 0.01, "max_gradient_norm": 1.0,
                      "learning_rate": [{"scheduler": "Linear", "initial_learning_rate": 1e-3,
                                         "end_learning_rate": 1e-4, "total_iters": 10}]},
        "runconfig": {"max_steps": STEPS, "num_wgt_servers": 2, "model_dir": str(tmp_path / "model"), **runconfig},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(p))
    return path, p


def fit(params, *args, timeout=240):
    return subprocess.run([sys.executable, "-m", "pyapi.cli", "fit", str(params), *args], capture_output=True,
                          text=True, timeout=timeout)


def reference(p, steps):
    """Weights and optimizer state after `steps` single-process reference steps on the same data."""
    model = build_model(p["model"])
    params = model.init_params(0)
    o = p["optimizer"]
    opt = make_optimizer("AdamW", lr=0.0, weight_decay=o["weight_decay"])
    state = {k: opt.init_state(v) for k, v in params.items()}
    schedule = make_schedule(o["learning_rate"])
    t_in = p["train_input"]
    stream = GlobalStream(t_in["data_dir"], shuffle=t_in["shuffle"], seed=t_in["shuffle_seed"])
    losses = []
    for t in range(steps):
        ex = stream.read(t * t_in["batch_size"], t_in["batch_size"])
        batch = {k: np.ascontiguousarray(ex[:, i]) for i, k in enumerate(("input_ids", "loss_mask", "labels"))}
        r = reference_step(model, params, state, opt, batch, micro_batch_size=t_in["micro_batch_size"],
                           step=t + 1, lr=schedule(t), max_gradient_norm=o["max_gradient_norm"])
        losses.append(r.loss)
    stream.close()
    return params, state, losses


def assert_bits(ckpt_dir, params, state):
    got, got_state = Checkpoint(ckpt_dir).load()
    for k in params:
        assert got[k].tobytes() == params[k].tobytes(), k
        for s in state[k]:
            assert got_state[k][s].tobytes() == state[k][s].tobytes(), (k, s)


@pytest.mark.parametrize("num_csx,workers", [(1, 1), (2, 2), (4, 1)])
def test_bit_identical_to_the_reference(tmp_path, data, num_csx, workers):
    """Weights and optimizer state after 3 steps equal the single-process reference, bit for bit."""
    path, p = params_file(tmp_path, data, num_workers_per_csx=workers)
    proc = fit(path, "--num_csx", str(num_csx))
    assert proc.returncode == 0, proc.stderr
    params, state, losses = reference(p, STEPS)
    assert_bits(tmp_path / "model", params, state)
    metrics = [json.loads(x) for x in (tmp_path / "model" / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == losses
    assert (tmp_path / "model" / "plan.json").exists() and any((tmp_path / "model" / "logs").iterdir())


def test_sparse_gpt2_trains_bit_identically_and_checkpoints_only_nonzeros(tmp_path, data):
    """model.sparsity 0.9: loss falls; num_csx 1 and 2 give the reference's bits; the checkpoint holds
    the nonzeros and the mask, and converts to dense [out, in] weights."""
    steps = 12
    path, p = params_file(tmp_path, data, max_steps=steps)
    p["model"]["sparsity"] = 0.9
    p["optimizer"]["learning_rate"] = 3e-3
    path.write_text(yaml.safe_dump(p))
    params, state, losses = reference(p, steps)
    model = build_model(p["model"])
    for n in (1, 2):
        model_dir = tmp_path / f"csx{n}"
        proc = fit(path, "--num_csx", str(n), "--model_dir", str(model_dir))
        assert proc.returncode == 0, proc.stderr
        assert_bits(model_dir, params, state)
        metrics = [json.loads(x) for x in (model_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["loss"] for m in metrics] == losses
    assert np.mean(losses[-3:]) < losses[0] - 0.5
    ckpt = Checkpoint(tmp_path / "csx2")
    name = "blocks.0.mlp.fc.weight"
    st = model.structures[name]
    assert ckpt.tensors[f"model/{name}"]["shape"] == [st.nnz] and st.nnz == 128 * 3  # 10% of 32 per row, 128 rows
    assert ckpt.tensors[f"optimizer/{name}/exp_avg"]["shape"] == [st.nnz]
    assert sorted(ckpt.sparse_names()) == sorted(model.structures)
    dense = ckpt.dense(ckpt.load([name])[0])[name]
    assert dense.shape == (128, 32) and np.count_nonzero(dense) <= st.nnz
    np.testing.assert_array_equal(dense[st.row_indices(), st.indices], params[name])
    plan_bytes = json.loads((tmp_path / "csx2" / "plan.json").read_text())["plan"]["unit_bytes"]
    dense_bytes = build_model({k: v for k, v in p["model"].items() if k != "sparsity"}).unit_bytes()
    assert plan_bytes[1] < 0.2 * dense_bytes[1]  # a block streams about a tenth of its dense bytes


def test_resume_continues_bit_identically(tmp_path, data):
    """2 steps, stop, resume from latest to 4: the same bits as 4 steps in one go."""
    path, p = params_file(tmp_path, data, max_steps=4)
    assert fit(path, "--num_csx", "2", "--set", "runconfig.max_steps=2").returncode == 0
    assert Checkpoint(tmp_path / "model").step == 2
    proc = fit(path, "--num_csx", "2")
    assert proc.returncode == 0, proc.stderr
    params, state, _ = reference(p, 4)
    assert_bits(tmp_path / "model", params, state)

    # wse validate: the eval loss of that checkpoint, against the unfused numpy layers.
    p["eval_input"] = {"data_dir": str(data), "batch_size": 8, "micro_batch_size": 4}
    path.write_text(yaml.safe_dump(p))
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "validate", str(path), "--eval_steps", "3", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    model = build_model(p["model"], ops=numpy_ops)
    ex = GlobalStream(str(data)).read(0, 24)
    batch = {k: np.ascontiguousarray(ex[:, i]) for i, k in enumerate(("input_ids", "loss_mask", "labels"))}
    loss_sum, tokens, _ = model.loss(model.forward({k: v.astype(np.float64) for k, v in params.items()}, batch)[0],
                                     batch)
    assert got["step"] == 4 and got["examples"] == 24 and got["tokens"] == tokens
    assert abs(got["eval_loss"] - loss_sum / tokens) < 1e-5 * loss_sum / tokens
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "validate", str(path), "--checkpoint_path",
                           str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == (f"wse validate: error: {tmp_path / 'nowhere'}: "
                                                            "no such checkpoint or model directory")


def test_bad_params_fail_before_mpiexec(tmp_path, data):
    path, _ = params_file(tmp_path, data)
    proc = fit(path, "--set", "optimizer.learning_rate=fast")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("optimizer.learning_rate: expected a number or a "
                                                                  "list of schedulers, got 'fast'")
    assert not (tmp_path / "model").exists()
    proc = fit(path, "--set", "model.max_position_embeddings=16")
    assert proc.returncode == 1 and "model.max_position_embeddings: 16 is shorter than the max_seq_length" in proc.stderr


def test_an_exception_in_a_role_ends_the_job_with_one_line(tmp_path, data):
    """A damaged data file makes an input worker raise: the job ends, naming that rank and role."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in sorted(data.glob("*.h5"))[:2]:
        (bad / f.name).write_bytes(f.read_bytes())
    target = bad / "data-00002.h5"
    target.write_bytes(sorted(data.glob("*.h5"))[2].read_bytes())
    with h5py.File(target) as f:
        offset = f["data"].id.get_chunk_info(5).byte_offset
    raw = bytearray(target.read_bytes())
    raw[offset + 3] ^= 0xFF  # example 5 of the third file now fails its checksum when read
    target.write_bytes(bytes(raw))
    path, _ = params_file(tmp_path, bad, max_steps=40)
    t0 = time.monotonic()
    proc = fit(path, "--num_csx", "2", "--set", "train_input.shuffle=false")
    assert proc.returncode == 1 and time.monotonic() - t0 < 60
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("wse fit: rank ") and "(worker " in line and "data-00002.h5" in line, proc.stderr


@pytest.mark.parametrize("victim,sig", [("csx", signal.SIGKILL), ("memoryx", signal.SIGKILL), ("csx", signal.SIGSTOP)],
                         ids=["kill-csx", "kill-memoryx", "stop-csx"])
def test_a_killed_or_stopped_rank_ends_the_job_within_30_seconds(tmp_path, data, victim, sig):
    """SIGKILL: the watchdog sees the process vanish. SIGSTOP: its peers time out after
    runconfig.peer_timeout (default 20 s) and the launcher finds the stopped process."""
    path, p = params_file(tmp_path, data, max_steps=10000)
    job = subprocess.Popen([sys.executable, "-m", "pyapi.cli", "fit", str(path), "--num_csx", "2"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    model_dir = tmp_path / "model"
    deadline = time.monotonic() + 60
    metrics = model_dir / "metrics.jsonl"
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.2)  # step 1 done: every rank is up and past its imports
    plan = json.loads((model_dir / "plan.json").read_text())["plan"]
    rank = plan["csx"][1] if victim == "csx" else plan["memoryx"][0]
    os.kill(int((model_dir / "logs" / f"pid_rank_{rank}").read_text()), sig)
    t0 = time.monotonic()
    out, err = job.communicate(timeout=60)
    assert time.monotonic() - t0 < 30
    assert job.returncode == 1
    line = err.strip().splitlines()[-1]
    what = "died" if sig == signal.SIGKILL else "stopped answering"
    assert line.startswith(f"wse fit: rank {rank} ({victim} ") and what in line, err
