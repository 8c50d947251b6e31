"""Scripts written for Cerebras' PyTorch API run with one changed import (``pyapi.cstorch``): the same
bits on the CPU backend and on 1, 2 and 4 CS-2s, eager PyTorch's losses, one line for what is not built."""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

#: The shape of Cerebras' "custom training loop" tutorial (an FC model on MNIST-like data made here),
#: as a user writes it; only the import differs from a script for a real system.
MODEL_AND_DATA = '''
import torch

torch.manual_seed(0)


class FC(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


def input_fn(batch_size):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(512, 1, 8, 8, generator=g)
    y = (x.sum(dim=(1, 2, 3)) * 10 / 64).long().clamp(max=9)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, drop_last=True)
'''
SCRIPT = MODEL_AND_DATA + '''
import sys
import pyapi.cstorch as cstorch

kind, num_csx, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
backend = cstorch.backend(kind, num_csx=num_csx, artifact_dir=out + "/artifacts", micro_batch_size=4)
model = FC()
compiled = cstorch.compile(model, backend)
optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-2)
loss_fn = torch.nn.CrossEntropyLoss()


@cstorch.trace
def training_step(inputs, targets):
    loss = loss_fn(compiled(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@cstorch.step_closure
def print_loss(loss, step):
    print(f"step {step} loss {loss.item()!r}")


@cstorch.checkpoint_closure
def save_checkpoint(step):
    cstorch.save({"model": model.state_dict(), "step": step}, f"{out}/checkpoint_{step}.h5")


train_dataloader = cstorch.utils.data.DataLoader(input_fn, 16)
executor = cstorch.utils.data.DataExecutor(train_dataloader, num_steps=steps, checkpoint_steps=3)
for step, (inputs, targets) in enumerate(executor, start=1):
    loss = training_step(inputs, targets)
    print_loss(loss, step)
    save_checkpoint(step)
torch.save(model.state_dict(), f"{out}/final.pt")
'''


def run_script(tmp_path, text, *args, timeout=300):
    script = tmp_path / "train.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)


def train(tmp_path, kind, num_csx, steps=6):
    out = tmp_path / f"{kind}{num_csx}"
    out.mkdir()
    proc = run_script(tmp_path, SCRIPT, kind, num_csx, steps, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    return out, losses, torch.load(out / "final.pt")


def test_the_tutorials_script_gives_the_same_bits_on_cpu_and_on_1_2_and_4_cs2s(tmp_path):
    import pyapi.cstorch as cstorch

    runs = {(kind, n): train(tmp_path, kind, n) for kind, n in (("CPU", 1), ("CSX", 1), ("CSX", 2), ("CSX", 4))}
    (_, reference, weights), *others = runs.values()
    assert len(reference) == 6 and reference[-1] < reference[0]
    for out, losses, w in others:
        assert losses == reference, out
        for name in weights:
            assert torch.equal(w[name], weights[name]), (out, name)
    # the checkpoint closure ran on steps 3 and 6 with the model holding those steps' weights
    out = runs[("CSX", 2)][0]
    assert sorted(p.name for p in out.glob("checkpoint_*.h5")) == ["checkpoint_3.h5", "checkpoint_6.h5"]
    last = cstorch.load(out / "checkpoint_6.h5")
    assert last["step"] == 6 and all(torch.equal(last["model"][n], weights[n]) for n in weights)
    third = cstorch.load(out / "checkpoint_3.h5")
    assert not torch.equal(third["model"]["net.1.weight"], weights["net.1.weight"])


def test_the_tutorials_script_has_eager_pytorchs_losses_over_20_steps(tmp_path):
    _, losses, _ = train(tmp_path, "CPU", 1, steps=20)
    user = {}
    exec(MODEL_AND_DATA, user)  # the same module, seed and data, trained by plain PyTorch
    model = user["FC"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.0)  # cstorch's defaults
    batches = list(user["input_fn"](16))
    for step in range(20):
        inputs, targets = batches[step % len(batches)]
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5), step


@pytest.mark.parametrize("changes,message", [
    ([("self.net = torch.nn.Sequential(torch.nn.Flatten(),", "self.net = torch.nn.Sequential(torch.nn.Flatten(), "
       "torch.nn.BatchNorm1d(64),")], "model.net.1: BatchNorm1d updates its running statistics in forward"),
    ([("    loss.backward()\n", "    print(loss.item())\n    loss.backward()\n")], ".item()"),
    ([("drop_last=True", "drop_last=False"), ("DataLoader(input_fn, 16)", "DataLoader(input_fn, 24)")],
     "DataLoader: batch 22 has 8 samples, batch 1 has 24: the captured step takes one batch size (drop_last=True)"),
    ([("cstorch.optim.AdamW(model.parameters(), lr=1e-2)", "cstorch.optim.Lamb(model.parameters(), lr=1e-2)")],
     "cstorch.optim.Lamb: not built in wse-cluster (built: SGD, Adam, AdamW)"),
])
def test_what_cannot_run_is_one_line(tmp_path, changes, message):
    out = tmp_path / "out"
    out.mkdir()
    text = SCRIPT
    for change in changes:
        assert change[0] in text
        text = text.replace(*change)
    proc = run_script(tmp_path, text, "CPU", 1, 40, out)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert message in last, proc.stderr[-2000:]


def test_the_example_script_runs_as_written(tmp_path):
    """examples/cstorch_fc.py, which the README shows: 50 steps on 2 CS-2s, a checkpoint, the loss falls."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "cstorch_fc.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 5 and losses[-1] < 0.5 * losses[0], proc.stdout
    import pyapi.cstorch as cstorch

    saved = cstorch.load(tmp_path / "checkpoint_50.h5")
    assert set(saved) == {"model", "optimizer"} and saved["model"]["net.1.weight"].shape == (128, 784)


def test_optimizers_and_schedulers_become_the_runs_optimizer_section():
    """Cerebras' constructors, as a script calls them, give the params the cluster checks and runs."""
    import pyapi.cstorch as cstorch
    from pyapi.cstorch.errors import NotBuilt
    from wse_core.optim import make_schedule

    params = [torch.nn.Parameter(torch.zeros(2))]
    adamw = cstorch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
    warmup = cstorch.optim.lr_scheduler.LinearLR(adamw, initial_learning_rate=0.0, end_learning_rate=0.1,
                                                 total_iters=5)
    decay = cstorch.optim.lr_scheduler.CosineDecayLR(adamw, initial_learning_rate=0.1, end_learning_rate=0.0,
                                                     total_iters=10)
    cstorch.optim.lr_scheduler.SequentialLR(adamw, [warmup, decay], milestones=[5])
    spec = adamw.spec()
    assert spec["optimizer_type"] == "AdamW" and spec["eps"] == 1e-6 and spec["weight_decay"] == 0.01
    schedule = make_schedule(spec["learning_rate"])
    assert [schedule(t) for t in (0, 5, 15)] == pytest.approx([0.0, 0.1, 0.0])
    sgd = cstorch.optim.SGD(params, lr=0.5, momentum=0.9, nesterov=True)
    assert sgd.spec() == {"optimizer_type": "SGD", "learning_rate": 0.5, "weight_decay": 0.0, "momentum": 0.9,
                          "nesterov": True}
    with pytest.raises(NotBuilt, match="parameter groups with their own lr"):
        cstorch.optim.SGD([{"params": params}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0}], lr=0.5)
    with pytest.raises(NotBuilt, match=r"cstorch.optim.lr_scheduler.OneCycleLR: not built"):
        cstorch.optim.lr_scheduler.OneCycleLR
