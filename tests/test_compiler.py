"""The graph compiler (wse_core.compiler): models a user would bring, captured, cut into streaming
units and run unit by unit, against eager PyTorch on the same weights."""
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from wse_core.compiler import CompileError, accumulate, add, capture, combine, partition, run_step  # noqa: E402
from wse_core.microbatch import tree_sum  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8  # samples in a global batch; micro-batches of 2 make 4 of them


@pytest.fixture(autouse=True)
def one_thread():
    """torch's results depend on its thread count (LayerNorm's backward): one thread, as the ranks will."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- models a user would bring
class Encoder(nn.Module):
    """Embedding, torch's TransformerEncoderLayers (a padding mask every layer reads), a classifier."""

    def __init__(self, dropout):
        super().__init__()
        self.embed = nn.Embedding(40, 32)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=dropout,
                                                               batch_first=True) for _ in range(2))
        self.head = nn.Linear(32, 4)

    def forward(self, ids, pad):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=pad)
        return self.head(h.mean(1))


def lm_loss(logits, targets):
    """Next-token cross-entropy of [B, T, V] logits, as a user's script writes it."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@cache
def case(name, dropout=0.0):
    """(model, global batch, loss_fn) of a named model, seeded; one object per (name, dropout)."""
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))
        return model, (torch.randn(BATCH, 12), torch.randint(0, 5, (BATCH,))), nn.CrossEntropyLoss()
    if name == "cnn":
        model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(8 * 2 * 2, 10))
        return model, (torch.randn(BATCH, 1, 8, 8), torch.randint(0, 10, (BATCH,))), nn.CrossEntropyLoss()
    if name == "encoder":
        ids = torch.randint(0, 40, (BATCH, 8))
        pad = torch.zeros(BATCH, 8, dtype=torch.bool)
        pad[1, 6:] = pad[5, 3:] = True
        return Encoder(dropout), (ids, pad, torch.randint(0, 4, (BATCH,))), nn.CrossEntropyLoss()
    ids = torch.randint(0, 64, (BATCH, 16))
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                         use_cache=False, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)  # lm_head.weight is transformer.wte.weight
    else:
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                          use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    return model, (ids, torch.roll(ids, -1, 1)), lm_loss


@cache
def captured(name, dropout=0.0):
    model, batch, loss_fn = case(name, dropout)
    return capture(model, batch, loss_fn, micro_batch=2)


@cache
def compiled(name, dropout=0.0):
    return partition(captured(name, dropout))


def eager(name, batch=None):
    """Loss and gradients of eager forward + loss.backward() on the whole batch."""
    model, default, loss_fn = case(name)
    batch = default if batch is None else batch
    model.zero_grad(set_to_none=True)
    loss = loss_fn(_logits(model(*batch[:-1])), batch[-1])
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def params_of(name, dropout=0.0):
    return dict(case(name, dropout)[0].named_parameters())


MODELS = ["mlp", "cnn", "encoder", "gpt2", "llama"]


# ----------------------------------------------------------------------------- against eager
@pytest.mark.parametrize("name", MODELS)
def test_one_micro_batch_gives_eager_bits(name):
    """With one micro-batch the runner's loss and every gradient are eager loss.backward()'s, bit for bit."""
    loss, grads = run_step(compiled(name), params_of(name), case(name)[1], BATCH, step=1, seed=0)
    want_loss, want = eager(name)
    assert torch.equal(loss, want_loss)
    assert list(grads) == list(want)
    assert [k for k in want if not torch.equal(grads[k], want[k])] == []


@pytest.mark.parametrize("name", MODELS)
def test_four_micro_batches_agree_with_eager_on_the_global_batch(name):
    """Four micro-batches weighted into the global batch's mean: eager's loss and gradients to float32 rounding."""
    loss, grads = run_step(compiled(name), params_of(name), case(name)[1], 2, step=1, seed=0)
    want_loss, want = eager(name)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    for k in want:  # atol: entries that cancel to ~0 have no relative precision
        torch.testing.assert_close(grads[k], want[k], rtol=1e-5, atol=1e-6 * want[k].abs().max().item(), msg=k)


def test_ignored_targets_are_counted_over_the_global_batch():
    """A mean cross-entropy with ignored targets (one micro-batch all ignored) is the global batch's token mean."""
    ids, targets = case("gpt2")[1]
    targets = targets.clone()
    targets[0, :5] = targets[3, 9:] = -100
    targets[4:6] = -100  # the third micro-batch of 2: weighs 0
    loss, grads = run_step(compiled("gpt2"), params_of("gpt2"), (ids, targets), 2, step=1, seed=0)
    want_loss, want = eager("gpt2", (ids, targets))
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    for k in want:
        torch.testing.assert_close(grads[k], want[k], rtol=1e-5, atol=1e-6 * want[k].abs().max().item(), msg=k)
    with pytest.raises(ValueError, match="the loss counts no term in the whole batch"):
        run_step(compiled("gpt2"), params_of("gpt2"), (ids, torch.full_like(targets, -100)), 2, step=1, seed=0)


# ----------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", ["encoder", "gpt2"])
def test_same_bits_twice_and_for_any_grouping_of_micro_batches(name):
    """With dropout 0.1: the same bits run twice, and whether micro-batches are taken as [4], [2, 2] or
    [1, 1, 1, 1] groups reduced by the tree (num_csx 1, 2, 4); the caller's generator is left as it was."""
    units, params, batch = compiled(name, 0.1), params_of(name, 0.1), case(name, 0.1)[1]
    rng = torch.get_rng_state()
    loss, grads = run_step(units, params, batch, 2, step=3, seed=7)
    assert torch.equal(torch.get_rng_state(), rng)
    again = run_step(units, params, batch, 2, step=3, seed=7)
    for group in (2, 1):
        parts = [accumulate(units, params, batch, 2, step=3, seed=7, lo=lo, hi=lo + group) for lo in range(0, 4, group)]
        total_loss, unit_grads = tree_sum(parts, add)
        assert torch.equal(total_loss, loss)
        grouped = combine(unit_grads, params)
        assert all(torch.equal(grouped[k], grads[k]) for k in grads)
    assert torch.equal(again[0], loss) and all(torch.equal(again[1][k], grads[k]) for k in grads)
    other_step = run_step(units, params, batch, 2, step=4, seed=7)[0]
    assert not torch.equal(other_step, loss)  # the masks are keyed by the step: dropout is on


# ----------------------------------------------------------------------------- partition
def test_gpt2_is_a_head_two_blocks_and_a_tail_whose_flops_add_up_to_the_model():
    """GPT-2's units: the head (embeddings, mask), its two blocks, the tail (ln_f, the tied lm_head, the
    loss); their FLOPs add up to eager's whole count on the example micro-batch."""
    units = compiled("gpt2")
    assert [u.name for u in units] == ["head", "model.transformer.h.0", "model.transformer.h.1", "tail"]
    assert "transformer.wte.weight" in units[0].params and "transformer.wte.weight" in units[-1].params
    assert units[1].flops_forward > 0 and units[1].flops_backward == 2 * units[1].flops_forward
    assert units[1].boundary_bytes == 2 * 16 * 32 * 4  # the residual stream of the example micro-batch of 2
    model, (ids, targets), _ = case("gpt2")
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(ids[:2]).logits, targets[:2]).backward()
    assert sum(u.flops_forward + u.flops_backward for u in units) == counter.get_total_flops()
    total = sum(p.numel() * 4 for p in model.parameters())
    assert sum(u.param_bytes for u in units) == total + model.lm_head.weight.numel() * 4  # streamed twice


def test_units_can_be_named_by_class():
    """units=[GPT2Block] cuts at each instance: the same units as the default cut."""
    model, batch, loss_fn = case("gpt2")
    units = partition(capture(model, batch, loss_fn, micro_batch=2),
                      units=[transformers.models.gpt2.modeling_gpt2.GPT2Block])
    assert [u.name for u in units] == [u.name for u in compiled("gpt2")]


def test_elements_without_parameters_join_the_unit_before_them():
    """A Sequential's ReLU and pooling stream nothing: they run in the unit of the layer before them."""
    assert [u.name for u in compiled("mlp")] == ["model.0", "model.2", "model.4", "tail"]
    assert [u.name for u in compiled("cnn")] == ["model.0", "model.3", "model.7", "tail"]
    assert [u.name for u in compiled("encoder")] == ["head", "model.layers.0", "model.layers.1", "tail"]


def test_a_block_whose_ops_run_around_another_is_refused():
    """Units stream in running order: a block called again after a later one cannot be one unit."""
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))

        def forward(self, x):
            return self.blocks[0](self.blocks[1](self.blocks[0](x)))

    graph = capture(Twice(), (torch.randn(4, 6), torch.randint(0, 6, (4,))), nn.CrossEntropyLoss())
    with pytest.raises(CompileError, match=r"^model\.blocks\.0: linear_2 \(aten\.linear in model\.blocks\.0\) runs "
                                           r"after ops of a later unit \(model\.blocks\.1\)"):
        partition(graph)


# ----------------------------------------------------------------------------- refusals, one line each
class Gate(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc, self.how = nn.Linear(6, 6), how

    def forward(self, x):
        y = self.fc(x)
        if self.how == "branch":
            if y.sum() > 0:
                return y * 2
            return y
        if self.how == "item":
            return y / y.abs().max().item()
        return y + y.flatten()[torch.nonzero(y.flatten() > 0)[:, 0]].sum()  # "nonzero"


class Block(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.gate = Gate(how)

    def forward(self, x):
        return x + self.gate(x)


class Net(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.blocks = nn.ModuleList(Block(how) for _ in range(2))
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _refusal(model, batch):
    with pytest.raises(CompileError) as raised:
        capture(model, batch, nn.CrossEntropyLoss())
    message = str(raised.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("how, says", [
    ("branch", r"^model\.blocks\.0\.gate: data-dependent control flow \(aten\.item: .*test_compiler\.py:\d+ "
               r"`if y\.sum\(\) > 0:`"),
    ("item", r"^model\.blocks\.0\.gate: \.item\(\) in forward \(aten\.item at test_compiler\.py:\d+ "
             r"`return y / y\.abs\(\)\.max\(\)\.item\(\)`\)"),
    ("nonzero", r"^model\.blocks\.0\.gate: data-dependent shape \(aten\.nonzero at test_compiler\.py:\d+"),
])
def test_data_dependent_python_is_refused_in_one_line(how, says):
    """A Python branch on a tensor, .item() and a data-dependent shape: one line naming the module and the op."""
    torch.manual_seed(0)
    message = _refusal(Net(how), (torch.randn(4, 6), torch.randint(0, 3, (4,))))
    assert re.match(says, message), message


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.fc = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(F.relu(self.bn1(self.conv1(x))).flatten(1))


def test_batch_norm_in_training_normalises_each_micro_batch_and_hands_its_statistics_out():
    """BatchNorm in training: a micro-batch of the whole batch gives eager's bits, and the graph hands
    out the batch's mean and unbiased variance (the running statistics' update) without writing a
    buffer; momentum=None is refused in one line; in eval mode it is a constant of its unit."""
    torch.manual_seed(0)
    model, batch = BatchNormNet(), (torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,)))
    before = [b.clone() for b in model.buffers()]
    graph = capture(model, batch, nn.CrossEntropyLoss())
    units = partition(graph)
    (path, momentum, mean, var), = graph.batch_norms
    assert (path, momentum) == ("model.bn1", 0.1) and [v.value for v in units[-1].values] == [mean, var]
    loss, grads = run_step(units, dict(model.named_parameters()), batch, 4, step=1, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))  # nothing written
    want = nn.CrossEntropyLoss()(model(batch[0]), batch[1])
    want.backward()
    assert torch.equal(loss, want.detach())
    assert all(torch.equal(grads[k], p.grad) for k, p in model.named_parameters())
    model.bn1.momentum = None
    assert _refusal(model, batch) == ("model.bn1: BatchNorm2d(momentum=None) keeps a cumulative average of its "
                                      "statistics; not supported in training (give it a momentum)")
    model.bn1.eval()
    model.zero_grad()
    loss, grads = run_step(partition(capture(model, batch, nn.CrossEntropyLoss())), dict(model.named_parameters()),
                           batch, 4, step=1, seed=0)
    want = nn.CrossEntropyLoss()(model(batch[0]), batch[1])
    want.backward()
    assert torch.equal(loss, want.detach())
    assert all(torch.equal(grads[k], p.grad) for k, p in model.named_parameters())


def test_a_model_that_fixes_the_batch_size_is_refused():
    """A view that spells the batch size out would run only micro-batches of that size: refused."""
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            return self.fc(x).view(4, 3)

    message = _refusal(Fixed(), (torch.randn(4, 6), torch.randint(0, 3, (4,))))
    assert message.startswith("model: the model's code fixes the batch size to 4")


def test_a_loss_without_a_batch_reduction_is_refused():
    """A loss the runner cannot weigh by micro-batch (here a max) is refused before any step runs."""
    model, batch, _ = case("mlp")
    with pytest.raises(CompileError, match=r"^step: the loss \(aten\.amax\) does not end in a mean or sum"):
        partition(capture(model, batch, lambda out, y: (out - 0 * y[:, None]).amax()))


# ----------------------------------------------------------------------------- mixed precision
@pytest.fixture(scope="module")
def gpt2_program(tmp_path_factory):
    """GPT-2's program file (wse_core.compiler.model.save_program)."""
    from wse_core.compiler.model import save_program

    path = tmp_path_factory.mktemp("program") / "gpt2.pt2"
    save_program(captured("gpt2"), compiled("gpt2"), path)
    return str(path)


@pytest.mark.parametrize("fp16_type", ["float16", "bfloat16", "cbfloat16"])
def test_a_compiled_model_in_mixed_precision_streams_and_hands_on_16_bit_values(gpt2_program, fp16_type):
    """model.mixed_precision (the family torch, as a CS-2 runs it: unit by unit): every
    weight a unit reads, every value it hands on or gets back as a gradient, every weight gradient is a
    number of the format; the loss is not rounded; the bits are those of the micro-batches one after the
    other (Model.forward_backward, the reference's); the loss is near float32's, not equal to it."""
    from wse_core.compiler.lower import SUM
    from wse_core.compiler.model import TorchModel, load_program
    from wse_core.nn.layers import DropoutKey
    from wse_core.nn.precision import FORMATS

    ids, targets = case("gpt2")[1]
    program, fmt = load_program(gpt2_program), FORMATS[fp16_type]
    batches = [{"ids": ids[i:i + 2].numpy().astype(np.int32), "mask": np.ones((2, 16), np.int32),
                "labels": targets[i:i + 2].numpy().astype(np.int32)} for i in range(0, BATCH, 2)]
    drops = [DropoutKey(0, 1, i) for i in range(0, BATCH, 2)]

    def built(**precision):
        m = TorchModel({"name": "torch", "program": gpt2_program, **precision}, program)
        return m, m.compute_weights(m.init_params(0))

    m, weights = built(mixed_precision=True, fp16_type=fp16_type)
    xs, saved, seen = [m.first_input(b, np.float32) for b in batches], [], list(weights.values())
    tail = m.torch_units[-1].outputs[0]
    for u in range(len(m.units)):  # each unit on every micro-batch
        xs, kept = zip(*[m.unit_forward(u, x, {p: weights[p] for p in m.unit_params[u]}, d) for x, d in zip(xs, drops)])
        saved.append(kept)
        seen += [v.detach().numpy() for x in xs for k, v in x.items()  # the loss and its float64 sum: not rounded
                 if k not in ("input", tail, tail + SUM) and isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert all(fmt.round(x[tail].detach().numpy()) != x[tail].detach().numpy() for x in xs)  # float32, not rounded
    losses = [m.loss(x, b, 1024.0) for x, b in zip(xs, batches)]
    dys, grads = [dy for _, _, dy in losses], []
    for u in reversed(range(len(m.units))):
        dys, g = zip(*[m.unit_backward(u, dy, k, {p: weights[p] for p in m.unit_params[u]})
                       for dy, k in zip(dys, saved[u])])
        grads.append(g)
        seen += [v.numpy() for dy in dys for v in dy.values()] + [a for gs in g for a in gs.values()]
    assert len(seen) > 100 and all(np.array_equal(fmt.round(a), a) for a in seen)
    for j, (b, d) in enumerate(zip(batches, drops)):  # a micro-batch's forward and backward in turn: the same bits
        loss_sum, n, unit_grads, _ = m.forward_backward(weights, b, d, 1024.0)
        assert (loss_sum, n) == losses[j][:2]
        assert all(np.array_equal(unit_grads[u][p], grads[-1 - u][j][p]) for u in range(len(m.units))
                   for p in unit_grads[u])
    f32, w32 = built()
    loss32 = f32.forward_backward(w32, batches[0], drops[0])[0]
    assert losses[0][0] != loss32 and losses[0][0] == pytest.approx(loss32, rel=1e-2)


# ----------------------------------------------------------------------------- the optional dependency
def test_importing_wse_core_does_not_import_torch():
    """torch is optional: wse_core alone never loads it, and wse_core.compiler without it says what to install."""
    check = "import sys, wse_core; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)
    missing = "import sys; sys.modules['torch'] = None; import wse_core.compiler"
    run = subprocess.run([sys.executable, "-c", missing], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == \
        "ImportError: wse_core.compiler needs PyTorch: pip install -e '.[torch]'"


def _trained(model, batch, micro_batch_size, lr, steps=2):
    """(losses, the weights' bytes) of ``steps`` AdamW reference steps of a compiled ``model`` on ``batch``."""
    from wse_core.nn import reference_step
    from wse_core.optim import AdamW

    params = model.init_params(0)
    opt = AdamW(lr=lr)
    state = {k: opt.init_state(v) for k, v in params.items()}
    losses = [reference_step(model, params, state, opt, batch, micro_batch_size=micro_batch_size, step=t).loss
              for t in range(1, steps + 1)]
    return losses, b"".join(params[k].tobytes() for k in model.param_names)


MLP = """
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
x = torch.rand(128, 1, 8, 8, generator=g)
y = (x.mean(dim=(1, 2, 3)) * 20).long().clamp(max=9)
loss_fn = torch.nn.CrossEntropyLoss()
"""


@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder", "gpt2", "llama"])
def test_a_lowered_user_model_has_the_same_bits_for_any_micro_batch_size(tmp_path, name):
    """The five models a user brings (test_cstorch.py's, and an MLP of the tutorial's shape): captured,
    lowered (lower.py: products, norms, embeddings, attention, the loss, convolutions a sample at a
    time, every sum over samples a tree) and trained through the family torch, micro-batches of 1, 2,
    4, 8 and 16 give the same weights, bit for bit, and the first step's loss is eager PyTorch's within
    1e-6."""
    from test_cstorch import MODELS

    from wse_core.compiler.model import save_program
    from wse_core.models import build_model

    code, call = MODELS.get(name, (MLP, "compiled(inputs)"))
    if "transformers" in code:
        pytest.importorskip("transformers")
    user = {"torch": torch}
    torch.manual_seed(0)
    exec("g = torch.Generator().manual_seed(1)\n" + code, user)
    model, x, y, loss_fn = user["model"], user["x"][:16], user["y"][:16], user["loss_fn"]
    graph = capture(model, (x, y), loss_fn)
    save_program(graph, partition(graph), tmp_path / "m.pt2", layout="tensors")
    lowered = build_model({"name": "torch", "program": str(tmp_path / "m.pt2")})
    assert lowered.batch_dependent is None, lowered.batch_dependent
    batch = lowered.batch_of([x.numpy(), y.numpy()])

    first = _trained(lowered, batch, 1, lr=1e-2)
    for size in (2, 4, 8, 16):
        assert _trained(lowered, batch, size, lr=1e-2)[1] == first[1], size
    out = model(x)
    assert first[0][0] == pytest.approx(loss_fn(out.logits if call.endswith(".logits") else out, y).item(), rel=1e-6)


def _lm_program(tmp_path, name, model):
    """``model`` (a transformers causal LM) captured on 4 sequences of 16 tokens, written lowered."""
    from wse_core.compiler.model import save_program

    rng = np.random.default_rng(0)
    ids, labels = (torch.from_numpy(rng.integers(0, 257, (4, 16))).long() for _ in range(2))
    graph = capture(model, (ids, labels),
                    lambda logits, target: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)))
    save_program(graph, partition(graph), tmp_path / f"{name}.pt2")
    return str(tmp_path / f"{name}.pt2")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_lowered_transformers_model_has_the_same_bits_for_any_micro_batch_size(tmp_path, name):
    """transformers' GPT2LMHeadModel (Conv1D's addmm, layer norms, the causal mask it builds, a tied head)
    and LlamaForCausalLM (grouped-query attention, RMSNorm's weight broadcast, rotary, an untied head):
    their weight products, norms, embeddings, attention and loss run on the kernels (lower.py), every sum
    over samples a tree, so micro-batches of 1, 2, 4 and 8 train to the same weights; the step's loss
    is torch's within 1e-6."""
    from wse_core.models import build_model

    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=257, n_positions=16, use_cache=False, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=257, max_position_embeddings=16, use_cache=False, bos_token_id=0, eos_token_id=0))
    program = _lm_program(tmp_path, name, model)
    lowered = build_model({"name": "torch", "program": program})
    assert lowered.batch_dependent is None
    share = lowered.lowering()
    assert share["torch_flops"] < 0.1, share
    rng = np.random.default_rng(1)
    ex = rng.integers(0, 257, (8, 3, 16)).astype(np.int32)
    ex[:, 1] = 1
    ex[2, 1, :5] = 0
    batch = lowered.batch_of([ex])

    first = _trained(lowered, batch, 1, lr=1e-3)
    for size in (2, 4, 8):
        assert _trained(lowered, batch, size, lr=1e-3)[1] == first[1], size
    ids, labels = torch.from_numpy(ex[:, 0]).long(), torch.from_numpy(np.where(ex[:, 1] != 0, ex[:, 2], -100)).long()
    eager = F.cross_entropy(model(ids).logits.reshape(-1, 257), labels.reshape(-1)).item()
    assert first[0][0] == pytest.approx(eager, rel=1e-6)


@pytest.mark.parametrize("layer,op", [
    (lambda: nn.Dropout(0.1), "dropout draws its random numbers for the whole micro-batch (left to torch)"),
    (lambda: nn.BatchNorm1d(16), "broadcasts a weight over the batch (left to torch)"),
    (lambda: nn.PReLU(16), "prelu broadcasts a weight over the batch (left to torch)"),
])
def test_an_op_left_to_torch_that_sums_over_the_micro_batch_is_named(tmp_path, layer, op):
    """Each way a lowered step can still sum over its micro-batch in torch (a dropout's mask drawn at once,
    a BatchNorm's statistics, a weight a torch op broadcasts) is named: the model's batch_dependent, which
    `wse compile`'s bits line and cstorch say."""
    from wse_core.compiler.model import save_program
    from wse_core.models import build_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), layer(), nn.Linear(16, 3))
    graph = capture(model, (torch.randn(4, 8), torch.randint(0, 3, (4,))), nn.CrossEntropyLoss())
    save_program(graph, partition(graph), tmp_path / "m.pt2", layout="tensors")
    why = build_model({"name": "torch", "program": str(tmp_path / "m.pt2")}).batch_dependent
    assert why is not None and why.endswith(op), why


class _FlatBias(nn.Module):
    """A bias added to the rows of [B * T, C] (samples of T rows each), then a mean over tokens."""

    def __init__(self):
        super().__init__()
        self.w, self.b, self.head = nn.Linear(6, 6, bias=False), nn.Parameter(torch.randn(6)), nn.Linear(6, 3)

    def forward(self, x):
        b, t, c = x.shape
        return self.head((self.w(x).reshape(-1, c) + self.b).reshape(b, t, c).mean(1))


class _ClassToken(nn.Module):
    """A learned token put before every sample's (ViT's class token): torch's expand sums its gradient."""

    def __init__(self):
        super().__init__()
        self.cls, self.head = nn.Parameter(torch.randn(1, 1, 6)), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1).mean(1))


@pytest.mark.parametrize("module,why", [(_FlatBias, None),
                                        (_ClassToken, "head: expand broadcasts a weight over the batch (left to torch)")])
def test_samples_of_several_rows_are_summed_as_samples_and_a_weight_expanded_over_the_batch_is_named(
        tmp_path, module, why):
    """A bias broadcast over [B * T, C]'s rows has its gradient summed a sample (T rows) at a time, so any
    micro-batch size gives the same bits; a weight torch's expand copies over the batch is named."""
    from wse_core.compiler.model import save_program
    from wse_core.models import build_model

    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 6), torch.randint(0, 3, (16,))
    graph = capture(module(), (x, y), nn.CrossEntropyLoss())
    save_program(graph, partition(graph), tmp_path / "m.pt2", layout="tensors")
    model = build_model({"name": "torch", "program": str(tmp_path / "m.pt2")})
    assert model.batch_dependent == why
    if why is None:
        batch = model.batch_of([x.numpy(), y.numpy()])
        first = _trained(model, batch, 1, lr=1e-2, steps=1)
        assert all(_trained(model, batch, size, lr=1e-2, steps=1) == first for size in (2, 4, 16))
