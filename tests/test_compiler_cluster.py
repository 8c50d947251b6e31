"""A user's own PyTorch model, compiled (``wse_core.compiler``), trained by the emulated cluster as the
model family ``torch``: the same bits for any number of CS-2s, eager PyTorch's losses."""
import json

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")

from data_tools.checkpoint import Checkpoint  # noqa: E402
from data_tools.preprocess import preprocess_arrays, preprocess_text  # noqa: E402
from wse_core.compiler import capture, partition  # noqa: E402
from pyapi.job import Job  # noqa: E402
from wse_core.compiler.model import save_program  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                          torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.layers(x)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    d = tmp_path_factory.mktemp("arrays")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 8)).astype(np.float32), rng.integers(0, 3, 256)
    np.savez(d / "d.npz", features=x, labels=y)
    preprocess_arrays(d / "d.npz", d / "data")
    return d / "data", x, y


def compile_to(path, model, example, loss_fn):
    graph = capture(model, example, loss_fn)
    save_program(graph, partition(graph), path)
    return str(path)


def fit(jobs, tmp_path, data, program, num_csx, steps=4, lr=0.01, name="m"):
    model_dir = tmp_path / f"{name}{num_csx}"
    p = {"train_input": {"data_dir": str(data), "batch_size": 8, "micro_batch_size": 2, "shuffle": False},
         "model": {"name": "torch", "program": program},
         "optimizer": {"optimizer_type": "AdamW", "learning_rate": lr},
         "runconfig": {"max_steps": steps, "num_csx": num_csx, "model_dir": str(model_dir)}}
    (tmp_path / f"{name}{num_csx}.yaml").write_text(yaml.safe_dump(p))
    proc = jobs.run("fit", tmp_path / f"{name}{num_csx}.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in map(json.loads, (model_dir / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    return Checkpoint(model_dir).load()[0], losses


def test_a_compiled_torch_mlp_has_the_same_bits_on_1_and_4_cs2s(jobs, tmp_path, arrays):
    """(2 CS-2s against 1: the transformers GPT-2's test.)"""
    data, x, y = arrays
    torch.manual_seed(0)
    program = compile_to(tmp_path / "mlp.pt2", MLP(dropout=0.1), (torch.from_numpy(x[:8]), torch.from_numpy(y[:8])),
                         torch.nn.CrossEntropyLoss())
    (w1, l1), (w4, l4) = (fit(jobs, tmp_path, data, program, n) for n in (1, 4))
    assert l1 == l4 and len(l1) == 4
    for name in w1:
        assert np.array_equal(w1[name], w4[name]), name
    # torch's dropout draws a micro-batch's mask at once: the bits hold at one micro-batch size, and `wse compile`
    # says so; the rest is lowered to the kernels
    lines = Job.from_yaml(tmp_path / "m1.yaml").compile().lines()
    assert ("bits: the single-process reference's at micro_batch_size 2, and another micro-batch size's differ "
            "(model.layers.0: dropout draws its random numbers for the whole micro-batch (left to torch))" in lines), lines
    assert any(line.startswith("kernels: ") and line.endswith("of the FLOPs lowered to the wafer's kernels; left to "
                                                               "torch: dropout, relu") for line in lines), lines


def test_a_compiled_torch_mlp_trains_as_eager_pytorch_does(jobs, tmp_path, arrays):
    """No dropout: the cluster's losses are eager PyTorch's (torch.optim.AdamW on the same batches) within
    1e-5, and so are its final weights."""
    data, x, y = arrays
    torch.manual_seed(1)
    model = MLP(dropout=0.0)
    eager = MLP(dropout=0.0)
    eager.load_state_dict(model.state_dict())
    program = compile_to(tmp_path / "mlp.pt2", model, (torch.from_numpy(x[:8]), torch.from_numpy(y[:8])),
                         torch.nn.CrossEntropyLoss())
    weights, losses = fit(jobs, tmp_path, data, program, 2, steps=6)
    opt = torch.optim.AdamW(eager.parameters(), lr=0.01, weight_decay=0.0)
    for step in range(6):
        xb, yb = torch.from_numpy(x[8 * step:8 * step + 8]), torch.from_numpy(y[8 * step:8 * step + 8])
        loss = torch.nn.functional.cross_entropy(eager(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5), step
    for name, p in eager.named_parameters():
        np.testing.assert_allclose(weights[name], p.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_transformers_gpt2_trains_on_two_cs2s_with_the_bits_of_one(jobs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from data_tools.dataset import GlobalStream

    data = tmp_path / "lm"
    preprocess_text(["stdlib"], data, 16, samples_per_file=4000, progress=False)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=257, n_positions=16, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    ex = GlobalStream(data).read(0, 4)
    ids = torch.from_numpy(ex[:, 0]).long()
    labels = torch.from_numpy(np.where(ex[:, 1] != 0, ex[:, 2], -100)).long()

    def lm_loss(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    program = compile_to(tmp_path / "gpt2.pt2", transformers.GPT2LMHeadModel(cfg), (ids, labels), lm_loss)
    (w1, l1), (w2, l2) = (fit(jobs, tmp_path, data, program, n, steps=3, lr=1e-3, name="g") for n in (1, 2))
    assert l1 == l2 and all(np.isfinite(l1))
    for name in w1:
        assert np.array_equal(w1[name], w2[name]), name


def test_data_of_another_shape_than_the_capture_is_one_line(jobs, tmp_path, arrays):
    data, x, y = arrays
    program = compile_to(tmp_path / "mlp6.pt2", torch.nn.Linear(6, 3), (torch.zeros(4, 6), torch.zeros(4).long()),
                         torch.nn.CrossEntropyLoss())
    p = {"train_input": {"data_dir": str(data), "batch_size": 8},
         "model": {"name": "torch", "program": program},
         "optimizer": {"optimizer_type": "SGD", "learning_rate": 0.1},
         "runconfig": {"max_steps": 1, "model_dir": str(tmp_path / "m")}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(p))
    proc = jobs.run("fit", tmp_path / "p.yaml")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        f"train_input.data_dir: {data}: examples of shape [8]; this compiled model was captured on [6] (capture it "
        "on the data's shape)"), proc.stderr
