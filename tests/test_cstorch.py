"""Scripts written for Cerebras' PyTorch API run with one changed import (``pyapi.cstorch``): the same
bits on the CPU backend and on 1, 2 and 4 CS-2s, eager PyTorch's losses, one line for what is not built.

The script is ``examples/cstorch_fc.py`` (the shape of Cerebras' custom-training-loop tutorial), run
as a user runs it."""
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import read_events

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cstorch_fc.py"


def run_script(cwd, text, *args):
    script = cwd / "train.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)  # a bound only a hang reaches


def train(tmp_path, kind, num_csx, steps=6, checkpoint_steps=3):
    """(losses, the last checkpoint's model state) of the example run as ``kind`` on ``num_csx``."""
    import pyapi.cstorch as cstorch

    out = tmp_path / f"{kind}{num_csx}"
    out.mkdir()
    proc = run_script(out, EXAMPLE.read_text(), kind, num_csx, steps, checkpoint_steps)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == steps, proc.stdout
    return out, losses, cstorch.load(out / f"checkpoint_{steps}.h5")["model"]


def test_the_tutorials_script_gives_the_same_bits_on_cpu_and_on_4_cs2s(tmp_path):
    """(2 CS-2s against the CPU backend: the models' and mixed precision's tests; 1 CS-2 against 4, a
    compiled model's: test_compiler_cluster.py. The CPU backend runs 1 CS-2's step in this process.)"""
    import pyapi.cstorch as cstorch

    (_, reference, weights), *others = (train(tmp_path, kind, n) for kind, n in (("CPU", 1), ("CSX", 4)))
    assert reference[-1] < reference[0]
    for out, losses, w in others:
        assert losses == reference, out
        for name in weights:
            assert torch.equal(w[name], weights[name]), (out, name)
    # the checkpoint closure ran on step 3 too, with the model holding that step's weights
    out = others[-1][0]
    assert sorted(p.name for p in out.glob("checkpoint_*.h5")) == ["checkpoint_3.h5", "checkpoint_6.h5"]
    third = cstorch.load(out / "checkpoint_3.h5")
    assert set(third) == {"model", "optimizer"}
    assert not torch.equal(third["model"]["net.1.weight"], weights["net.1.weight"])


def test_the_tutorials_script_has_eager_pytorchs_losses_over_20_steps(tmp_path):
    _, losses, _ = train(tmp_path, "CPU", 1, steps=20, checkpoint_steps=20)
    spec = importlib.util.spec_from_file_location("cstorch_fc", EXAMPLE)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)  # its model and data; the loop is under __main__
    torch.manual_seed(0)
    model = user.FC()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)  # cstorch's defaults
    for step, (inputs, targets) in enumerate(user.input_fn(64)):
        if step == 20:
            break
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5), step


@pytest.mark.parametrize("changes,message", [
    ([("torch.nn.Flatten(), torch.nn.Linear(784, 128)", "torch.nn.Flatten(), torch.nn.BatchNorm1d(784, momentum=None), "
       "torch.nn.Linear(784, 128)")], "model.net.1: BatchNorm1d(momentum=None) keeps a cumulative average of its "
                                      "statistics; not supported in training (give it a momentum)"),
    ([("        loss.backward()\n", "        print(loss.item())\n        loss.backward()\n")],
     "tensor.item() inside the traced step: not built in wse-cluster"),
    ([("drop_last=True", "drop_last=False"), ("DataLoader(input_fn, 64)", "DataLoader(input_fn, 100)")],
     "DataLoader: batch 41 has 96 samples, batch 1 has 100: the captured step takes one batch size (drop_last=True)"),
    ([("    return torch.utils.data.DataLoader(", "    return [(x[..., :27] if i == 2 else x, y) for i, (x, y) in enumerate("
       "torch.utils.data.DataLoader("), ("drop_last=True, generator=g)\n", "drop_last=True, generator=g))]\n")],
     "DataLoader: batch 3's [0] is float32 [64, 1, 28, 27], batch 1's [0] float32 [64, 1, 28, 28]: the captured "
     "step takes one shape and dtype (pad to one length)"),
    ([("cstorch.optim.AdamW(model.parameters(), lr=1e-3)", "cstorch.optim.Lamb(model.parameters(), lr=1e-3)")],
     "cstorch.optim.Lamb: not built in wse-cluster (built: SGD, Adam, AdamW, configure_optimizer"),
])
def test_what_cannot_run_is_one_line(tmp_path, changes, message):
    text = EXAMPLE.read_text()
    for old, new in changes:
        assert old in text
        text = text.replace(old, new)
    proc = run_script(tmp_path, text, "CPU", 1, 45, 45)
    assert proc.returncode != 0
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_the_example_script_runs_as_written(tmp_path):
    """`python examples/cstorch_fc.py`, as the README shows it: 50 steps on 2 CS-2s, a checkpoint; the wait
    before the first step said on stderr (the capture, the ranks starting and ready), not a silence."""
    import pyapi.cstorch as cstorch

    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = proc.stderr.splitlines()
    assert said[0].startswith("cstorch: capturing training_step"), said
    assert any(line.startswith("cstorch: starting 7 MPI ranks") and "run.log" in line for line in said), said
    assert any(line.startswith("cstorch: 7 ranks ready in ") for line in said), said
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 50 and losses[-1] < 0.5 * losses[0], proc.stdout
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
    other = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(NotBuilt, match="parameter groups with their own momentum"):
        cstorch.optim.SGD([{"params": params}, {"params": other, "momentum": 0.5}], lr=0.5, momentum=0.9)
    with pytest.raises(NotBuilt, match=r"parameter groups with weight decays \[0.1, 0.2\]"):
        cstorch.optim.SGD([{"params": params, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.2}], lr=0.5)
    grouped = cstorch.optim.SGD([{"params": params}, {"params": other, "lr": 0.25, "weight_decay": 0.1}], lr=0.5)
    assert grouped.spec()["weight_decay"] == 0.1
    assert grouped.groups() == {id(params[0]): (1.0, False), id(other[0]): (0.5, True)}
    with pytest.raises(NotBuilt, match=r"cstorch.optim.lr_scheduler.OneCycleLR: not built"):
        cstorch.optim.lr_scheduler.OneCycleLR


#: Models a user would bring (none written for this project), each with its data: a step of (inputs,
#: targets), no dropout (so eager PyTorch sees the same function).
MODELS = {
    "cnn": ('''
model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                            torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                            torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10))
x = torch.rand(128, 1, 16, 16, generator=g)
y = (x.mean(dim=(1, 2, 3)) * 20).long().clamp(max=9)
loss_fn = torch.nn.CrossEntropyLoss()
''', "compiled(inputs)"),
    "encoder": ('''
class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                                          for _ in range(2))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


model = Encoder()
x = torch.randint(0, 32, (128, 12), generator=g)
y = x[:, 0] % 4
loss_fn = torch.nn.CrossEntropyLoss()
''', "compiled(inputs)"),
    "gpt2": ('''
import transformers
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    bos_token_id=0, eos_token_id=0, use_cache=False))
x = torch.randint(0, 64, (128, 16), generator=g)
y = torch.where(torch.rand(128, 16, generator=g) < 0.9, x.roll(-1, dims=1), -100)


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
''', "compiled(inputs).logits"),
    "llama": ('''
import transformers
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False))
x = torch.randint(0, 64, (128, 16), generator=g)
y = x.roll(-1, dims=1)


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
''', "compiled(inputs).logits"),
}

MODEL_SCRIPT = '''
import sys
import torch
import pyapi.cstorch as cstorch

kind, num_csx, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
{model}
backend = cstorch.backend(kind, num_csx=num_csx)   # micro-batches of 16 on the CPU, of 8 on two CS-2s: the same bits
compiled = cstorch.compile(model, backend)
optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-2)


@cstorch.trace
def training_step(inputs, targets):
    loss = loss_fn({call}, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def input_fn():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn), num_steps=4)
for step, (inputs, targets) in enumerate(executor, 1):
    print(f"step {{step}} loss {{training_step(inputs, targets).item()!r}}")
cstorch.save({{"model": model.state_dict()}}, out + "/final.h5")
'''


def same_bits_on_two_backends(tmp_path, text, backends):
    """(losses, final weights) of the script ``text`` (MODEL_SCRIPT's shape) run on each of two
    ``backends`` ((kind, num_csx) pairs), which must give the same losses and weights, bit for bit."""
    import pyapi.cstorch as cstorch

    runs = []
    for kind, n in backends:
        out = tmp_path / f"{kind}{n}"
        out.mkdir()
        proc = run_script(out, text, kind, n, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(([float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")],
                     cstorch.load(out / "final.h5")["model"]))
    (losses, weights), (losses2, weights2) = runs
    assert losses == losses2 and len(losses) == 4
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)
    return losses, weights


def eager_run(code, call, make_optimizer, losses):
    """The same module, data and loss as the script's, trained eagerly by ``make_optimizer(model)`` for
    its 4 steps, each loss equal to the script's ``losses`` to 1e-5; returns (the model, its initial state)."""
    user = {"torch": torch}
    torch.manual_seed(0)
    exec("g = torch.Generator().manual_seed(1)\n" + code, user)
    model = user["model"]
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model)
    for step in range(4):
        inputs, targets = user["x"][16 * step:16 * step + 16], user["y"][16 * step:16 * step + 16]
        out = model(inputs)
        loss = user["loss_fn"](out.logits if call.endswith(".logits") else out, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5), step
    return model, initial


@pytest.mark.parametrize("name", ["llama"])
def test_models_a_user_brings_train_on_two_cs2s_with_the_bits_of_cpu_and_eager_pytorchs_losses(tmp_path, name):
    """On 2 CS-2s, the bits of the CPU backend (which are 1 CS-2's: the tutorial's test), each with the
    default micro-batch size (16 samples on the CPU, 8 on each CS-2: the lowered units' sums are trees
    over samples), and eager PyTorch's losses. (The CNN's: the parameter groups' test, which trains it
    so. The other models' bits for any micro-batch size, and their losses against eager:
    test_compiler.py::test_a_lowered_user_model_has_the_same_bits_for_any_micro_batch_size; GPT-2's on
    the cluster: test_compiler_cluster.py.)"""
    code, call = MODELS[name]
    if "transformers" in code:
        pytest.importorskip("transformers")
    losses, _ = same_bits_on_two_backends(tmp_path, MODEL_SCRIPT.format(model=code, call=call),
                                          (("CPU", 1), ("CSX", 2)))
    eager_run(code, call, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.0), losses)


def groups(model):
    """The common split: weight decay for matrices only, and the head at half the learning rate."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() > 1 and not n.startswith("7.")]},
            {"params": [p for n, p in named if p.dim() == 1], "weight_decay": 0.0},
            {"params": [p for n, p in named if p.dim() > 1 and n.startswith("7.")], "lr": 5e-3}]


#: MODEL_SCRIPT with the optimizer over ``groups`` (its source put in the script).
GROUPS_SCRIPT = MODEL_SCRIPT.replace(
    "optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-2)",
    inspect.getsource(groups).replace("{", "{{").replace("}", "}}")
    + "\noptimizer = cstorch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.1)")


def test_parameter_groups_with_their_own_lr_and_weight_decay_train_as_eager_pytorchs(tmp_path):
    code, call = MODELS["cnn"]
    losses, weights = same_bits_on_two_backends(tmp_path, GROUPS_SCRIPT.format(model=code, call=call),
                                                (("CPU", 1), ("CSX", 2)))
    model, initial = eager_run(code, call, lambda m: torch.optim.AdamW(groups(m), lr=1e-2, eps=1e-6, weight_decay=0.1),
                               losses)
    for k, w in model.state_dict().items():
        assert torch.allclose(weights[k], w, rtol=1e-4, atol=1e-6), k
        assert not torch.equal(weights[k], initial[k]), k


RESUME_SCRIPT = EXAMPLE.read_text().replace(
    "    loss_fn = torch.nn.CrossEntropyLoss()\n",
    """    loss_fn = torch.nn.CrossEntropyLoss()
    scheduler = cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=1e-3, end_learning_rate=1e-4,
                                                    total_iters=6)
    if len(sys.argv) > 5:  # resume: Cerebras' way, the states loaded into the model, optimizer and scheduler
        state = cstorch.load(sys.argv[5])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
""").replace(
    '{"model": model.state_dict(), "optimizer": optimizer.state_dict()}',
    '{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}').replace(
    'f"checkpoint_{step}.h5"', 'f"checkpoint_{scheduler.last_epoch}.h5"').replace(
    "DataLoader(input_fn, 64)", "DataLoader(lambda: list(input_fn(64))[scheduler.last_epoch:])").replace(
    "main(*sys.argv[1:2], *map(int, sys.argv[2:5]))", "main(sys.argv[1], *map(int, sys.argv[2:5]))")


def test_a_run_resumed_from_a_scripts_checkpoint_has_the_bits_of_one_that_never_stopped(tmp_path):
    """A script saves model, optimizer and scheduler at step 3; the same script loads them and trains
    3 more steps, on 2 CS-2s: its weights, optimizer state and losses are those of 6 uninterrupted
    steps on the CPU backend."""
    import pyapi.cstorch as cstorch

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir(), resumed.mkdir()
    proc = run_script(whole, RESUME_SCRIPT, "CPU", 1, 6, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc2 = run_script(resumed, RESUME_SCRIPT, "CSX", 2, 3, 3, whole / "checkpoint_3.h5")
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    losses = [line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[-1] for line in proc2.stdout.splitlines() if line.startswith("step ")] == losses[3:]
    a, b = cstorch.load(whole / "checkpoint_6.h5"), cstorch.load(resumed / "checkpoint_6.h5")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert set(a["optimizer"]["state"]) == set(b["optimizer"]["state"]) == {str(i) for i in range(6)}
    for i, st in a["optimizer"]["state"].items():
        assert float(st["step"]) == 6 and set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(v, b["optimizer"]["state"][i][k]) for k, v in st.items())
    assert b["scheduler"] == {"last_epoch": 6}
    # the cluster resumed from a checkpoint of step 3 made from the loaded states
    assert (next(resumed.glob("cerebras_logs/run_*/model")) / "checkpoint_3" / "index.h5").is_file()


def test_a_loop_left_early_ends_its_job_and_leaves_no_process(tmp_path):
    """A loop that breaks at step 2 of 2,000 ends the cluster's job there (not after its last step),
    and leaves no rank behind."""
    from mpi_launch.launcher import job_processes
    from mpi_launch.rundir import RunDir

    text = EXAMPLE.read_text().replace("        save_checkpoint(step)\n", "        save_checkpoint(step)\n"
                                       "        if step == 2:\n            break\n")
    proc = run_script(tmp_path, text, "CSX", 2, 2000, 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("step ")] == ["1:", "2:"]
    run = next(tmp_path.glob("cerebras_logs/run_*"))
    assert "the job was stopped before its last step" in (run / "run.log").read_text()
    assert max(r["step"] for r in RunDir(run / "model").read_metrics()) < 2000
    assert not job_processes(tmp_path)
#: One script, a loop per precision given (each from the same initial weights): float32; float16 by
#: autocast() in the step, with a dynamic GradScaler whose first scale overflows float16 gradients;
#: bfloat16 by set_half_dtype, without a scaler (bfloat16 needs none).
MIXED_SCRIPT = '''
import contextlib
import sys
import torch
import pyapi.cstorch as cstorch

kind, num_csx, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(1)
x = torch.randn(64, 16, generator=g)
y = x[:, :4].argmax(dim=1)
for half in sys.argv[4:]:
    if half == "bfloat16":
        cstorch.amp.set_half_dtype(torch.bfloat16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    compiled = cstorch.compile(model, cstorch.backend(kind, num_csx=num_csx, micro_batch_size=8))
    optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0 ** 15, steps_per_increase=2)

    @cstorch.trace
    def training_step(inputs, targets):
        with cstorch.amp.autocast() if half == "float16" else contextlib.nullcontext():
            loss = torch.nn.functional.cross_entropy(compiled(inputs), targets)
        if half == "float16":
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        return loss

    loader = cstorch.utils.data.DataLoader(lambda: torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=16))
    for step, (inputs, targets) in enumerate(cstorch.utils.data.DataExecutor(loader, num_steps=4), 1):
        print(f"{half} step {step} loss {training_step(inputs, targets).item()!r}")
    cstorch.save({"model": model.state_dict()}, f"{out}/{half}.h5")
'''


def test_mixed_precision_gives_the_same_bits_on_cpu_and_on_two_cs2s(tmp_path):
    """set_half_dtype, or autocast() in the traced step, trains the run in 16 bits (model.mixed_precision
    in its params): the CPU backend and 2 CS-2s give the same bits, a float16 step whose gradients
    overflow the scaled loss is skipped, and the losses are near the float32 run's, not equal to them."""
    import pyapi.cstorch as cstorch

    runs = {}
    for kind, n, halves in (("CPU", 1, ("float32", "float16", "bfloat16")), ("CSX", 2, ("float16", "bfloat16"))):
        out = tmp_path / kind
        out.mkdir()
        proc = run_script(out, MIXED_SCRIPT, kind, n, out, *halves)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for i, half in enumerate(halves):
            run = out / "cerebras_logs" / f"run_{i}"
            runs[kind, half] = ([float(line.split()[-1]) for line in proc.stdout.splitlines()
                                 if line.startswith(f"{half} step ")],
                                cstorch.load(out / f"{half}.h5")["model"],
                                yaml.safe_load((run / "params.yaml").read_text())["model"], run)
    losses32, weights32, model32, _ = runs["CPU", "float32"]
    assert "mixed_precision" not in model32 and len(losses32) == 4
    for half in ("float16", "bfloat16"):
        (losses, weights, model, _), (on_csx, weights_csx, model_csx, _) = runs["CPU", half], runs["CSX", half]
        for m in (model, model_csx):
            assert m["mixed_precision"] and m["fp16_type"] == half, m
        assert on_csx == losses, half
        assert all(torch.equal(weights_csx[k], weights[k]) for k in weights), half
        assert losses[0] != losses32[0] and losses[0] == pytest.approx(losses32[0], rel=1e-3), half
        assert not all(torch.equal(weights[k], weights32[k]) for k in weights)
    skipped = [m["skipped"] for m in map(json.loads, (runs["CSX", "float16"][3] / "model" / "metrics.jsonl")
                                         .read_text().splitlines()) if "loss" in m]
    assert skipped[0] and not all(skipped), skipped
    assert runs["CPU", "bfloat16"][0] == pytest.approx(losses32, rel=1e-2)


def test_set_half_dtype_takes_cerebras_dtypes_and_says_what_it_refuses_in_one_line(tmp_path):
    import pyapi.cstorch as cstorch

    try:
        assert cstorch.amp.set_half_dtype("cbfloat16") is torch.float16  # Cerebras' proxy dtype
        assert cstorch.amp.set_half_dtype("float16") is torch.float16
        assert cstorch.amp.set_half_dtype(torch.bfloat16) is torch.bfloat16
        for bad in ("float8", torch.float32, None):
            with pytest.raises(ValueError) as refused:
                cstorch.amp.set_half_dtype(bad)
            assert str(refused.value).startswith(f"cstorch.amp.set_half_dtype: {bad!r} is not a half dtype")
            assert "\n" not in str(refused.value)
        assert cstorch.amp.get_half_dtype() is torch.bfloat16  # a refusal leaves the setting as it was
        cstorch.amp.use_bfloat16(False)
        assert cstorch.amp.get_half_dtype() is torch.float16
        cstorch.amp.use_bfloat16(True)
        model, losses = in_process_loop(tmp_path / "a")  # the CPU backend, in this process, in bfloat16
        assert losses[1] < losses[0]
        params = yaml.safe_load(next((tmp_path / "a").glob("run_*/params.yaml")).read_text())
        assert params["model"]["fp16_type"] == "bfloat16" and params["model"]["mixed_precision"]
        cstorch.amp.set_half_dtype("cbfloat16")
        with pytest.raises(ValueError, match=r"^cstorch.amp: the half dtype cbfloat16 needs dynamic loss scaling"):
            in_process_loop(tmp_path / "b")
    finally:
        assert not cstorch.amp.enable_mixed_precision(False)  # the other tests of this process train in float32
    in_process_loop(tmp_path / "c")
    params = yaml.safe_load(next((tmp_path / "c").glob("run_*/params.yaml")).read_text())
    assert "mixed_precision" not in params["model"]


def test_a_script_can_target_a_running_appliance(tmp_path, jobs):
    """backend("CSX", appliance=SOCKET): the job is queued on the appliance, which runs it as its user;
    the loop gets its losses and weights as from a job of its own, with the CPU backend's bits."""
    socket, state = tmp_path / "appliance.sock", tmp_path / "state"
    try:
        started = jobs.run("appliance", "start", "--num_csx", 2, "--state_dir", state, "--socket", socket)
        assert started.returncode == 0, started.stderr
        text = EXAMPLE.read_text().replace("micro_batch_size=16)", f"micro_batch_size=16, appliance={str(socket)!r})")
        out = tmp_path / "queued"
        out.mkdir()
        proc = run_script(out, text, "CSX", 2, 4, 4)
        assert proc.returncode == 0, proc.stderr[-3000:]
        queued = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
        log = next(out.glob("cerebras_logs/run_*/run.log")).read_text()
        assert log.startswith("queued on the appliance as job "), log
    finally:
        jobs.run("appliance", "stop", "--socket", socket)  # whatever it says; the jobs fixture kills the rest
    _, direct, weights = train(tmp_path, "CPU", 1, steps=4, checkpoint_steps=4)
    import pyapi.cstorch as cstorch

    assert queued == direct
    saved = cstorch.load(out / "checkpoint_4.h5")["model"]
    assert all(torch.equal(saved[k], weights[k]) for k in weights)


def test_summarize_scalar_writes_tensorboard_beside_the_runs_own_scalars(tmp_path):
    pytest.importorskip("tensorboardX")

    text = EXAMPLE.read_text().replace("        print_loss(loss, step)\n",
                                       "        print_loss(loss, step)\n        cstorch.summarize_scalar('my/loss', loss)\n")
    out = tmp_path / "out"
    out.mkdir()
    proc = run_script(out, text, "CPU", 1, 3, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    events = read_events(next(out.glob("cerebras_logs/run_*/model/train")))
    assert events["my/loss"] == [(s, pytest.approx(v)) for s, v in enumerate(losses, 1)]



def in_process_loop(tmp_path, *, frozen=False, second_step=False, changing=False, steps=2):
    """A small loop on the CPU backend in this process (what a notebook does)."""
    import pyapi.cstorch as cstorch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if frozen:
        model[0].bias.requires_grad_(False)
    compiled = cstorch.compile(model, cstorch.backend("CPU", artifact_dir=tmp_path))
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)

    seen = {"step": 0}

    @cstorch.trace
    def train_step(x, y):
        if changing and seen["step"] >= 3:  # a Python decision the captured graph cannot make
            x = x * 2
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        return loss

    @cstorch.trace
    def other_step(x, y):
        return torch.nn.functional.cross_entropy(compiled(x), y)

    data = [(torch.rand(4, 4), torch.tensor([0, 1, 0, 1]))] * steps  # one batch again: its loss falls
    losses = []
    for step, (x, y) in enumerate(cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data)), 1):
        seen["step"] = step
        losses.append(float((other_step if second_step and step == 2 else train_step)(x, y)))
    return model, losses


def test_what_a_loop_cannot_do_is_one_line(tmp_path):
    from pyapi.cstorch.errors import NotBuilt

    with pytest.raises(NotBuilt, match=r"^model.0.bias: a frozen parameter \(requires_grad=False\): not built"):
        in_process_loop(tmp_path / "a", frozen=True)
    with pytest.raises(NotBuilt, match=r"^other_step: a second traced function in one DataExecutor loop"):
        in_process_loop(tmp_path / "b", second_step=True)
    with pytest.raises(NotBuilt, match=r"^train_step: the step's graph changed at step 3 \(its op 1 is aten.mul.Tensor "
                                       r"\[4, 4\] of 2; captured: aten.t.default \[4, 8\]\): not built"):
        in_process_loop(tmp_path / "d", changing=True, steps=4)
    model, losses = in_process_loop(tmp_path / "c")  # and the backend's process is usable after all three
    assert len(losses) == 2 and losses[1] < losses[0]


def test_an_evaluation_loop_gives_eager_pytorchs_eval_losses_of_the_trained_model(tmp_path, capsys):
    """A second executor whose traced step calls no backward nor optimizer evaluates the model as it
    is after training (its mode: eval, so no dropout): each step's loss is eager PyTorch's. Training,
    torch's dropout draws a micro-batch's mask at once: said in one line (its bits hold at one
    micro-batch size)."""
    import json

    import pyapi.cstorch as cstorch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 2))
    initial = [p.detach().clone() for p in model.parameters()]
    compiled = cstorch.compile(model, cstorch.backend("CPU", artifact_dir=tmp_path, micro_batch_size=4))
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.5)

    @cstorch.trace
    def train_step(x, y):
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        return loss

    @cstorch.trace
    def eval_step(x, y):
        return torch.nn.functional.cross_entropy(compiled(x), y)

    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(3)]
    loader = cstorch.utils.data.DataLoader(lambda: data)
    for x, y in cstorch.utils.data.DataExecutor(loader):
        train_step(x, y)
    trained = [p.detach().clone() for p in model.parameters()]
    assert not torch.equal(initial[0], trained[0])  # the model holds the trained weights
    said = [line for line in capsys.readouterr().out.splitlines() if "the same bits on every backend" in line]
    assert len(said) == 1 and said[0].startswith("cstorch: the same bits on every backend at micro_batch_size 4 "
                                                 "only: ") and said[0].endswith(
        "dropout draws its random numbers for the whole micro-batch (left to torch)"), said
    with pytest.raises(ValueError, match=r"^evaluating a compiled model whose graph draws random numbers \(dropout in "
                                         r"training mode\): call model.eval\(\) before the evaluation loop$"):
        for x, y in cstorch.utils.data.DataExecutor(loader):
            eval_step(x, y)
    compiled.eval()
    losses = [float(eval_step(x, y)) for x, y in cstorch.utils.data.DataExecutor(loader)]
    with torch.no_grad():
        assert losses == [pytest.approx(float(torch.nn.functional.cross_entropy(model(x), y)), rel=1e-6)
                          for x, y in data]
    assert all(torch.equal(a, b) for a, b in zip(trained, model.parameters()))  # an evaluation changes none
    metrics = next(p for p in sorted(tmp_path.glob("run_*/model/metrics.jsonl")))
    assert [json.loads(line)["eval_values"] for line in metrics.read_text().splitlines()] == [[x] for x in losses]


def test_step_closures_called_inside_the_traced_step_run_on_each_steps_values(tmp_path):
    """As Cerebras' scripts and schedulers do: a closure called in the step runs once the step is done,
    on its returned loss and on that step's Python values; summarize_scalar too. A closure given
    another of the step's tensors gets that tensor's value."""
    import json

    import pyapi.cstorch as cstorch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = cstorch.compile(model, cstorch.backend("CPU", artifact_dir=tmp_path))
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    logged, where = [], {"step": 0, "other": False}

    @cstorch.step_closure
    def log(loss, step, tag="train"):
        logged.append((step, tag, float(loss) if loss.dim() == 0 else loss))

    @cstorch.trace
    def train_step(x, y):
        logits = compiled(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        log(logits if where["other"] else loss, where["step"], tag="inside")
        cstorch.summarize_scalar("inside/loss", loss)
        return loss

    data = [(torch.rand(4, 4), torch.tensor([0, 1, 0, 1]))] * 4
    returned = []
    for step, (x, y) in enumerate(cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data)), 1):
        where["step"] = step
        returned.append(float(train_step(x, y)))
    assert logged == [(s, "inside", v) for s, v in enumerate(returned, 1)] and returned[-1] < returned[0]
    summaries = [json.loads(line) for line in next(tmp_path.glob("run_*/summaries.jsonl")).read_text().splitlines()]
    assert summaries == [{"step": s, "name": "inside/loss", "value": v} for s, v in enumerate(returned, 1)]
    # a closure the step calls on some steps only (not the first), as a logging interval does
    logged.clear()

    @cstorch.trace
    def sometimes(x, y):
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        if where["step"] % 4 == 0:
            log(loss, where["step"])
        return loss

    data12 = data * 3
    for step, (x, y) in enumerate(cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data12)), 1):
        where["step"] = step
        sometimes(x, y)
    assert [s for s, _, _ in logged] == [4, 8, 12]
    assert hasattr(cstorch, "mesh") is False and getattr(cstorch, "sparse", None) is None
    from pyapi.cstorch import run  # noqa: F401  (a submodule, imported on demand)
    # a closure given another of the step's tensors, its logits (a value per sample), gets that step's
    where["other"], where["step"] = True, 1
    logged.clear()
    with torch.no_grad():
        expected = model(data[0][0])  # the weights the first step computes with
    for x, y in cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data), num_steps=1):
        train_step(x, y)
    assert len(logged) == 1 and torch.allclose(logged[0][2], expected, rtol=1e-6, atol=1e-7)


def test_save_and_load_round_trip_a_state_with_scalars_and_nesting(tmp_path):
    import pyapi.cstorch as cstorch

    state = {"model": torch.nn.BatchNorm1d(3).state_dict(), "step": 7, "nested": {"a.b": torch.ones(2, 2)},
             "loss": torch.tensor(0.5)}
    cstorch.save(state, tmp_path / "s.h5")
    back = cstorch.load(tmp_path / "s.h5")
    assert back["step"] == 7 and torch.equal(back["nested"]["a.b"], torch.ones(2, 2))
    assert torch.equal(back["loss"], torch.tensor(0.5))
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())


def saved_state(tmp_path):
    """(the path of a cstorch.save file of a small model's weights and AdamW state after one step, its state)."""
    import pyapi.cstorch as cstorch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "global_step": 1}
    cstorch.save(state, tmp_path / "s.mdl")
    return tmp_path / "s.mdl", state


@pytest.mark.parametrize("key", ["model/0.weight", "optimizer/state/2/exp_avg_sq"])
def test_load_refuses_a_flipped_byte_of_a_weight_or_a_moment_naming_the_tensor(tmp_path, key):
    """One flipped bit in a weight (or an optimizer moment) of a cstorch.save file loaded without a word
    and a resume went on with other numbers: each tensor's SHA-256 is recorded and checked, as in the
    cluster's checkpoints."""
    import h5py

    import pyapi.cstorch as cstorch
    from data_tools.errors import CheckpointError

    path, state = saved_state(tmp_path)
    back = cstorch.load(path)
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items()) and back["global_step"] == 1
    with h5py.File(path, "r") as f:
        offset = f[key].id.get_offset()
    raw = bytearray(path.read_bytes())
    raw[offset + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=re.escape(f"cstorch.load: {path}: tensor {key} is damaged (SHA-256, ")):
        cstorch.load(path)


def test_load_refuses_a_truncated_state_file_in_one_line(tmp_path):
    """Cut at five points (inside the HDF5 signature, its metadata, a tensor, the last byte): refused in
    one line naming the file, never loaded, never handed to torch.load as a file of its own."""
    import pyapi.cstorch as cstorch
    from data_tools.errors import CheckpointError

    path, _ = saved_state(tmp_path)
    whole = path.read_bytes()
    for cut in (4, 300, len(whole) // 2, 3 * len(whole) // 4, len(whole) - 1):
        path.write_bytes(whole[:cut])
        with pytest.raises(CheckpointError) as refused:
            cstorch.load(path)
        said = str(refused.value)
        assert said.startswith(f"cstorch.load: {path}: ") and "\n" not in said and (
            "truncated or damaged" in said or "is damaged" in said), (cut, said)


def test_a_state_file_written_before_checksums_loads_said_unchecked(tmp_path, capsys):
    """A file of the first format (no SHA-256 of its tensors) still loads, with one line saying it is
    unchecked; a damaged table of a checked file is refused."""
    import h5py

    import pyapi.cstorch as cstorch
    from data_tools.errors import CheckpointError

    old = tmp_path / "old.mdl"
    with h5py.File(old, "w") as f:
        f.attrs["format"], f.attrs["values"] = "cstorch-state-1", json.dumps([[["global_step"], 3]])
        f["model/w"] = np.arange(6, dtype=np.float32).reshape(2, 3)
    back = cstorch.load(old)
    assert back["global_step"] == 3 and torch.equal(back["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert capsys.readouterr().err == (f"cstorch.load: {old}: unchecked (written before cstorch.save recorded "
                                       "checksums; save it again to have it checked)\n")
    path, _ = saved_state(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs["values"] = json.dumps([[["global_step"], 2]])  # another step
    with pytest.raises(CheckpointError, match="damaged: its metadata .* does not match its metadata_sha256"):
        cstorch.load(path)
