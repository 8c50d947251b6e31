"""Cerebras' PyTorch API as real scripts use it: batches of any structure, steps of one batch
argument, losses as users write them, evaluation under ``torch.no_grad()``, the streamer API,
Cerebras' package names, and one line for the modules not built."""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional


class _Head(torch.nn.Module):
    def __init__(self, form):
        super().__init__()
        self.lin = torch.nn.Linear(8, 5)
        self.form = form

    def forward(self, x, y, mask):
        logits = self.lin(x)
        b, t = x.shape[0], x.shape[1]
        per_token = F.cross_entropy(logits.view(-1, 5), y.view(-1), reduction="none").view(b, -1)
        if self.form == "sum over B*T":
            return per_token.sum() / (b * t)
        if self.form == "masked mean":
            return (per_token * mask).sum() / mask.sum()
        if self.form == "sum divided later, cast":
            return (F.cross_entropy(logits.view(-1, 5), y.view(-1), reduction="sum") / logits.shape[0]).to(torch.float32)
        if self.form == "sum over a constant":
            return per_token.sum() / 64
        if self.form == "ignore_index":
            return F.cross_entropy(logits.view(-1, 5), torch.where(mask > 0, y, -100).view(-1), ignore_index=-100)
        if self.form == "mean plus a weight penalty":
            return per_token.mean() + 1e-3 * self.lin.weight.pow(2).sum()
        if self.form == "masked mean plus mean":
            return (per_token * mask).sum() / mask.sum() + logits.pow(2).mean()
        return per_token.sum() / mask.sum().clamp(max=3)  # "a divisor that does not add up"


@pytest.mark.parametrize("form", ["sum over B*T", "masked mean", "sum divided later, cast", "sum over a constant",
                                  "ignore_index", "mean plus a weight penalty"])
def test_losses_as_users_write_them_weigh_micro_batches_as_eager_pytorch_weighs_the_batch(form):
    """Micro-batches of 2 of a batch of 8 give eager PyTorch's loss and gradients on the whole batch."""
    from wse_core.compiler import capture, partition, run_step

    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 8), torch.randint(0, 5, (8, 3))
    mask = (torch.rand(8, 3) > 0.3).float()
    model = _Head(form)
    units = partition(capture(model, (x, y, mask)))
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss, grads = run_step(units, params, (x, y, mask), micro_batch_size=2, step=1, seed=0)
    eager = model(x, y, mask)
    eager.backward()
    assert float(loss) == pytest.approx(float(eager), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)


def test_a_loss_whose_divisor_does_not_add_up_over_samples_or_whose_terms_weigh_differently_is_one_line():
    from wse_core.compiler import CompileError, capture, partition

    x, y, mask = torch.randn(8, 3, 8), torch.randint(0, 5, (8, 3)), torch.ones(8, 3)
    with pytest.raises(CompileError, match=r"its divisor is 3 on the example batch but 3 \+ 3 on its halves"):
        partition(capture(_Head("clamped"), (x, y, mask)))
    with pytest.raises(CompileError, match=r"adds terms reduced over the batch in different ways \(aten.div, aten.mean"):
        partition(capture(_Head("masked mean plus mean"), (x, y, mask)))


LM_SCRIPT = '''
import sys
import torch
import torch.nn.functional as F
import cerebras.pytorch as cstorch

V, T = 50, 16


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, 32)
        self.blocks = torch.nn.ModuleList([torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
                                           for _ in range(2)])
        self.head = torch.nn.Linear(32, V)

    def forward(self, ids, mask):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h, src_key_padding_mask=mask == 0)
        return self.head(h)


def input_fn(batch_size):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (256, T), generator=g)
    mask = torch.ones(256, T, dtype=torch.int32)
    mask[:, -3:] = 0
    labels = torch.where(mask == 1, torch.roll(ids, -1, 1), -100)
    return [{"input_ids": ids[i:i + batch_size], "attention_mask": mask[i:i + batch_size],
             "labels": labels[i:i + batch_size]} for i in range(0, 256, batch_size)]


torch.manual_seed(0)
backend = cstorch.backend(sys.argv[1], num_csx=int(sys.argv[2]), micro_batch_size=4)
model = LM()
compiled = cstorch.compile(model, backend)
optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-3)


@cstorch.trace
def training_step(batch):
    logits = compiled(batch["input_ids"], batch["attention_mask"])
    loss = F.cross_entropy(logits.view(-1, V), batch["labels"].view(-1), ignore_index=-100,
                           reduction="sum") / (batch["labels"] != -100).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    kept = batch["labels"] != -100
    accuracy = ((logits.argmax(-1) == batch["labels"]) & kept).float().sum() / kept.sum()
    return {"loss": loss.to(torch.float32), "accuracy": accuracy}


@cstorch.step_closure
def show(out, step):
    print(f"step {step}: {out['accuracy'].item()!r} loss {out['loss'].item()!r}")


executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn, 16), num_steps=4)
for step, batch in enumerate(executor, 1):
    show(training_step(batch), step)

compiled.eval()


@cstorch.trace
@torch.no_grad()
def eval_step(batch):
    logits = compiled(batch["input_ids"], batch["attention_mask"])
    loss = F.cross_entropy(logits.view(-1, V), batch["labels"].view(-1), ignore_index=-100)
    correct = (logits.argmax(-1) == batch["labels"]).float().sum()
    return {"loss": loss, "correct": correct}


executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn, 16), num_steps=2)
for batch in executor:
    out = eval_step(batch)
    print(f"eval {out['loss'].item()!r} {out['correct'].item()!r}")
'''


def on_backend(where, script, kind, num_csx):
    """The stdout of ``script`` run unchanged as ``train.py KIND NUM_CSX`` in ``where``."""
    where.mkdir()
    (where / "train.py").write_text(script)
    proc = subprocess.run([sys.executable, "-m", "pyapi.cstorch", "train.py", kind, str(num_csx)], capture_output=True,
                          text=True, cwd=where, timeout=600)  # a bound only a hang reaches
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_script_of_dict_batches_and_a_one_argument_step_trains_and_evaluates_as_eager_pytorch(tmp_path):
    """Run unchanged (``python -m pyapi.cstorch``, its ``import cerebras.pytorch`` as written): a batch
    dict with an attention mask, a loss summed and divided by its tokens, a cast, a step returning a
    dict with a masked accuracy, and an evaluation step under ``torch.no_grad()`` returning a dict:
    the same bits on the CPU backend and on 2 CS-2s, eager PyTorch's numbers."""
    cpu, csx = (on_backend(tmp_path / kind, LM_SCRIPT, kind, n) for kind, n in (("CPU", 1), ("CSX", 2)))
    assert cpu == csx
    lines = cpu.splitlines()
    steps = [(float(line.split()[2]), float(line.split()[-1])) for line in lines if line.startswith("step ")]
    evals = [tuple(map(float, line.split()[1:])) for line in lines if line.startswith("eval ")]
    user = {}
    exec(LM_SCRIPT.split("torch.manual_seed(0)")[0].replace("import cerebras.pytorch as cstorch", ""), user)
    torch.manual_seed(0)
    model = user["LM"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    batches = user["input_fn"](16)
    for step, batch in enumerate(batches[:4]):
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits.view(-1, 50), batch["labels"].view(-1), ignore_index=-100,
                               reduction="sum") / (batch["labels"] != -100).sum()
        kept = batch["labels"] != -100
        accuracy = ((logits.argmax(-1) == batch["labels"]) & kept).float().sum() / kept.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert steps[step][1] == pytest.approx(loss.item(), rel=1e-5), step
        assert steps[step][0] == pytest.approx(accuracy.item(), rel=1e-6), step
    model.eval()
    with torch.no_grad():
        for (loss, correct), batch in zip(evals, batches[:2]):
            logits = model(batch["input_ids"], batch["attention_mask"])
            assert loss == pytest.approx(F.cross_entropy(logits.view(-1, 50), batch["labels"].view(-1)).item(),
                                         rel=1e-5)
            assert correct == (logits.argmax(-1) == batch["labels"]).float().sum().item()
    assert len(evals) == 2 and len(steps) == 4


def test_cerebras_names_import_this_package_and_modules_not_built_are_one_line(tmp_path):
    (tmp_path / "model.py").write_text("import cerebras.pytorch as cstorch\n")
    (tmp_path / "train.py").write_text(
        "import cerebras_pytorch as cstorch\nimport model\nassert model.cstorch is cstorch\n"
        "from cerebras.pytorch.utils.tensorboard import SummaryWriter\n"
        "import cerebras.pytorch.distributed as dist\n"
        "print(dist.is_streamer(), dist.num_streamers(), dist.get_streaming_batch_size(8))\n"
        "import cerebras.pytorch.sparse\n")
    (tmp_path / "cerebras" / "modelzoo").mkdir(parents=True)  # Model Zoo's src/cerebras on the path: a namespace
    (tmp_path / "cerebras" / "modelzoo" / "__init__.py").write_text("")
    proc = subprocess.run([sys.executable, "-m", "pyapi.cstorch", "train.py"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.stdout.split() == ["False", "0", "8"], proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("pyapi.cstorch.alias.NotBuiltModule: cerebras.pytorch.sparse: "
                                                    "not built in wse-cluster (docs/user-guide.md lists what is)")


def test_a_loader_that_asks_the_streamer_api_is_made_per_streamer_and_dealt_to_the_cs2s(tmp_path):
    """On 2 CS-2s of 2 workers each, step t's batch is CS-2 0's share then CS-2 1's, each from that
    CS-2's worker t mod 2 (streamer 2 c + w), of the size get_streaming_batch_size gives it."""
    import pyapi.cstorch as cstorch
    from pyapi.cstorch import distributed

    def input_fn(batch_size):
        size = distributed.get_streaming_batch_size(batch_size)
        rank = distributed.get_streaming_rank() if distributed.is_streamer() else -1
        return [torch.full((size, 1), 100 * rank + i) for i in range(4)]

    cstorch.backend("CSX", cluster_config=distributed.ClusterConfig(num_csx=2, num_workers_per_csx=2),
                    artifact_dir=tmp_path)
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn, 5), num_steps=4)
    batches = executor._batches(cstorch.backend())
    got = [b.value[:, 0].tolist() for b in batches]
    # CS-2 0 takes 3 of 5 samples, CS-2 1 takes 2; worker w of CS-2 c is streamer 2c + w and serves
    # steps w, w + 2, ... from its own loader's batches 0, 1, ...
    assert got == [[0, 0, 0, 200, 200], [100, 100, 100, 300, 300], [1, 1, 1, 201, 201], [101, 101, 101, 301, 301]]
    # a loader that shards whole batches over the streamers (Cerebras/gigaGPT's data.py Sharder @
    # ebc1bbe9efa3bb4c07898c016ec3f88927ec0cab): the streamers take turns, the batches in their order

    def sharded(batch_size):
        rank = distributed.get_streaming_rank() if distributed.is_streamer() else 0
        count = distributed.num_streamers() if distributed.is_streamer() else 1
        return [torch.full((batch_size, 1), i) for i in range(8)][rank::count]

    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(sharded, 5), num_steps=6)
    assert [b.value[0, 0].item() for b in executor._batches(cstorch.backend())] == [0, 1, 2, 3, 4, 5]
    cstorch.backend("CPU", artifact_dir=tmp_path)  # the user node: one global stream
    batches = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn, 5), num_steps=2)._batches(
        cstorch.backend())
    assert [b.value[:, 0].tolist() for b in batches] == [[-100] * 5, [-99] * 5]


def test_the_rest_of_the_surface_scripts_call(tmp_path, capsys):
    """In one CPU loop: the backend's device and kinds, compute_num_steps, manual_seed, utils.nest, the
    executor's iteration and profiler in both generations' spellings, metrics updated in a training
    step and in an evaluation step, summarize_tensor through the executor's writer, the flags'
    micro-batch, and ClusterConfig's fields that mean nothing here said in one line."""
    import yaml

    import pyapi.cstorch as cstorch
    from pyapi.cstorch.utils import nest

    cstorch.backend("CSX", artifact_dir=tmp_path / "a", cluster_config=cstorch.distributed.ClusterConfig(
        num_csx=1, job_labels=["name=x"], mount_dirs=["."]))
    assert capsys.readouterr().err.strip() == ("cstorch.distributed.ClusterConfig: job_labels, mount_dirs: taken, and "
                                               "meaningless on the emulated cluster (its ranks run on this machine, "
                                               "in this Python)")
    backend = cstorch.backend("CPU", artifact_dir=tmp_path)
    assert backend.is_cpu and not backend.is_csx and cstorch.current_torch_device() == torch.device("cpu")
    cstorch.manual_seed(3)
    with backend.device:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    first = model[0].weight.detach().clone()
    cstorch.manual_seed(3)
    assert torch.equal(torch.nn.Linear(4, 8).weight, first)
    data = [(torch.randn(8, 4, generator=torch.Generator().manual_seed(i)), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
            for i in range(3)]
    loader = cstorch.utils.data.DataLoader(lambda: data)
    synthetic = cstorch.utils.data.SyntheticDataset((torch.zeros(4), lambda i: torch.tensor(i)), num_samples=4)
    assert [y.tolist() for _, y in torch.utils.data.DataLoader(synthetic, batch_size=2)] == [[0, 1], [2, 3]]
    assert torch.equal(cstorch.from_numpy(cstorch.to_numpy(cstorch.full((2,), 3.0))), torch.full((2,), 3.0))
    assert cstorch.utils.data.compute_num_steps(loader, num_epochs=2) == 6
    assert cstorch.utils.data.compute_num_steps(loader, initial_step=2, max_steps=5) == 3
    assert [(s, x.shape) for s, x in nest.visit_torch_tensors({"a": [data[0][0]], "b": 1})] == [(["a", "0"], (8, 4))]
    assert nest.map_torch_tensors(lambda scope, t: t.sum(), {"x": [torch.ones(2)]}) == {"x": [torch.tensor(2.0)]}
    compiled = cstorch.compile(model, backend)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    train_acc = cstorch.metrics.AccuracyMetric("train_accuracy")
    cstorch.backends.csx.performance.micro_batch_size = 4
    try:
        @cstorch.trace
        def train_step(x, y):
            logits = compiled(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            train_acc(labels=y, predictions=logits.argmax(-1))
            cstorch.summarize_tensor("logits", logits)
            return loss

        @cstorch.step_closure
        def fetched(loss, step):
            seen.append((step, executor.user_iteration, executor.iteration, executor.on_final_iteration))

        writer = cstorch.utils.tensorboard.SummaryWriter(log_dir=tmp_path / "tb")
        executor = cstorch.utils.data.DataExecutor(loader, num_steps=3, writer=writer, activation_steps=2)
        seen, before = [], [p.detach().clone() for p in model.parameters()]
        for step, (x, y) in enumerate(executor, 1):
            fetched(train_step(x, y), step)
        assert seen == [(2, 2, 1, False), (3, 3, 2, True)]  # activation steps: every second, and the last
        assert executor.profiler.rate_tracker.total_samples == 24 == executor.profiler.total_samples()
        assert executor.profiler.global_rate() == executor.profiler.rate_tracker.global_rate > 0
        params = yaml.safe_load(next(tmp_path.glob("run_*/params.yaml")).read_text())
        assert params["train_input"]["micro_batch_size"] == 4
    finally:
        cstorch.backends.csx.performance.micro_batch_size = cstorch.backends.DEFAULT
    assert cstorch.backends.csx.performance.micro_batch_size == "auto"
    # the metric and the summaries: each step's values, as eager PyTorch's on the weights of that step
    weights = [dict(zip(["0.weight", "0.bias", "2.weight", "2.bias"], before))]
    eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    eager.load_state_dict(weights[0])
    sgd = torch.optim.SGD(eager.parameters(), lr=0.1)
    correct = 0
    for step, (x, y) in enumerate(data, 1):
        logits = eager(x)
        correct += int((logits.argmax(-1) == y).sum())
        kept = tmp_path / "tb" / "tensors" / "logits" / f"{step}.pt"  # summaries too on activation steps only
        assert kept.exists() == (step > 1)
        if step > 1:
            kept = torch.load(kept)
            assert kept["step"] == step and torch.allclose(kept["tensor"], logits.detach(), rtol=1e-5, atol=1e-6)
        sgd.zero_grad()
        F.cross_entropy(logits, y).backward()
        sgd.step()
    assert float(train_acc) == correct / 24 and train_acc.num_updates == 3
    compiled.eval()
    accuracy, perplexity = cstorch.metrics.AccuracyMetric("accuracy"), cstorch.metrics.PerplexityMetric("perplexity")

    @cstorch.trace
    @torch.no_grad()
    def eval_step(x, y):
        logits = compiled(x)
        loss = F.cross_entropy(logits, y, reduction="sum")
        accuracy(labels=y, predictions=logits.argmax(-1))
        perplexity(labels=y, loss=loss)
        return loss

    for x, y in cstorch.utils.data.DataExecutor(loader, num_steps=3):
        eval_step(x, y)
    with torch.no_grad():
        logits = [model(x) for x, _ in data]
    want_acc = sum(int((lg.argmax(-1) == y).sum()) for lg, (_, y) in zip(logits, data)) / 24
    want_ppl = np.exp(sum(float(F.cross_entropy(lg, y, reduction="sum")) for lg, (_, y) in zip(logits, data)) / 24)
    assert float(accuracy) == pytest.approx(want_acc) and float(perplexity) == pytest.approx(want_ppl, rel=1e-6)
    assert {name for name, _ in cstorch.metrics.get_all_metrics()} >= {"accuracy", "perplexity", "train_accuracy"}


def test_a_compile_only_backend_captures_plans_and_runs_nothing(tmp_path, capsys):
    """compile_only: the step captured, the cluster planned and checked as `wse compile` does, one step
    of NaN values, no closure run and no rank started; validate_only: the capture alone."""
    import pyapi.cstorch as cstorch

    for kind in ("compile_only", "validate_only"):
        backend = cstorch.backend("CSX", artifact_dir=tmp_path / kind, num_csx=2, **{kind: True})
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        compiled = cstorch.compile(model, backend)
        optimizer = cstorch.optim.AdamW(model.parameters())
        fetched = []

        @cstorch.trace
        def train_step(x, y):
            loss = F.cross_entropy(compiled(x), y)
            loss.backward()
            optimizer.step()
            return loss

        @cstorch.step_closure
        def fetch(loss):
            fetched.append(loss.item())

        data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 2
        out = []
        for x, y in cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data), num_steps=2):
            out.append(train_step(x, y))
            fetch(out[-1])
        assert len(out) == 1 and torch.isnan(out[0]) and fetched == []
        err = capsys.readouterr().err
        assert "num_steps 2 taken as 1" in err
        assert not list((tmp_path / kind).glob("run_*/model/metrics.jsonl"))


def test_an_evaluation_with_a_batchnorm_in_training_mode_is_one_line(tmp_path):
    import pyapi.cstorch as cstorch
    from pyapi.cstorch.errors import NotBuilt

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    compiled = cstorch.compile(model, cstorch.backend("CPU", artifact_dir=tmp_path))

    @cstorch.trace
    @torch.no_grad()
    def eval_step(x, y):
        return F.cross_entropy(compiled(x), y)

    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    with pytest.raises(NotBuilt, match=r"^an evaluation step with model.1 \(BatchNorm1d\) in training mode"):
        for x, y in cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data), num_steps=1):
            eval_step(x, y)
    compiled.eval()
    for x, y in cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data), num_steps=1):
        with torch.no_grad():
            assert float(eval_step(x, y)) == pytest.approx(float(F.cross_entropy(model(x), y)), rel=1e-6)


def test_a_step_given_the_step_count_hands_its_closures_each_steps_value(tmp_path):
    """As Model Zoo's training_step(batch, step): a Python value among the step's arguments may change
    between calls; the graph is step 1's, and a closure in the step sees each step's value.
    compile(model, backend="CPU") takes the backend made already; the 2.0-era
    DataExecutor(micro_batch_size=) sets the run's micro-batch."""
    import yaml

    import pyapi.cstorch as cstorch

    backend = cstorch.backend("CPU", artifact_dir=tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    compiled = cstorch.compile(model, backend="CPU")
    assert cstorch.backend() is backend
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    logged = []

    @cstorch.step_closure
    def log(loss, step):
        logged.append((step, float(loss)))

    @cstorch.trace
    def training_step(batch, step):
        loss = F.cross_entropy(compiled(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        log(loss, step)
        return loss

    data = [(torch.randn(4, 4, generator=torch.Generator().manual_seed(i)), torch.tensor([0, 1, 0, 1]))
            for i in range(3)]
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data), micro_batch_size=2)
    losses = [float(training_step(batch, step)) for step, batch in enumerate(executor, 1)]
    assert logged == list(zip([1, 2, 3], losses))
    assert yaml.safe_load((executor.artifact_dir / "params.yaml").read_text())["train_input"]["micro_batch_size"] == 2


def test_a_python_value_the_graph_takes_changing_between_steps_is_one_line(tmp_path):
    """A number given to the step that its graph multiplies by is a constant of the graph: a step given
    another is refused, naming the op and both numbers, before it trains on step 1's."""
    import pyapi.cstorch as cstorch
    from pyapi.cstorch.errors import NotBuilt

    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    compiled = cstorch.compile(model, cstorch.backend("CPU", artifact_dir=tmp_path))
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)

    @cstorch.trace
    def train_step(x, y, weight):
        loss = F.cross_entropy(compiled(x), y) * weight
        loss.backward()
        optimizer.step()
        return loss

    data = [(torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))] * 3
    with pytest.raises(NotBuilt, match=r"^train_step: the step's graph changed at step 2 \(its op \d+ is aten.mul.Tensor "
                                       r"\[\] of 5.0; captured: aten.mul.Tensor \[\] of 1.0\)"):
        for step, (x, y) in enumerate(cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data)), 1):
            train_step(x, y, [1.0, 5.0, 10.0][step - 1])


BN_SCRIPT = '''
import sys
import torch
import cerebras.pytorch as cstorch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
backend = cstorch.backend(sys.argv[1], num_csx=int(sys.argv[2]), micro_batch_size=2)
compiled = cstorch.compile(model, backend)
optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)


@cstorch.trace
def step(x, y):
    loss = torch.nn.functional.cross_entropy(compiled(x), y)
    loss.backward()
    optimizer.step()
    return loss


g = torch.Generator().manual_seed(1)
data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
for x, y in cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data)):
    print("loss", repr(float(step(x, y))))
print("stats", [repr(v) for v in model[1].running_mean.tolist() + model[1].running_var.tolist()],
      int(model[1].num_batches_tracked))
'''


def test_batchnorms_running_statistics_have_the_same_bits_on_cpu_and_on_two_cs2s(tmp_path):
    """The micro-batches' statistics combined in the global batch's order: the same running statistics,
    bit for bit, whether one process or 2 CS-2s computed them (micro-batches of 2, 4 a step)."""
    cpu, csx = (on_backend(tmp_path / kind, BN_SCRIPT, kind, n) for kind, n in (("CPU", 1), ("CSX", 2)))
    assert cpu == csx and cpu.splitlines()[-1].endswith(" 12")
