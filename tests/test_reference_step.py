"""The single-process reference step: it learns real text, and its sums split exactly as the cluster will split them."""
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from wse_core.microbatch import MicroBatches, tree_sum
from wse_core.models import build_model
from wse_core.nn import accumulate, reference_step
from wse_core.optim import AdamW

EOT = 256
TINY_GPT2 = {"name": "gpt2", "vocab_size": 257, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4,
             "max_position_embeddings": 32}


def stdlib_tokens():
    """Bytes of a few standard-library modules, documents separated by end-of-text: real text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    ids = []
    for name in ("textwrap.py", "argparse.py", "dataclasses.py"):
        ids.extend((root / name).read_bytes())
        ids.append(EOT)
    return np.array(ids, np.int32)


def lm_batches(tokens, batch, seq):
    """Consecutive [batch, seq] windows of the stream with labels shifted by one."""
    n = batch * seq
    for start in range(0, len(tokens) - n - 1, n):
        chunk = tokens[start:start + n + 1]
        yield {"input_ids": chunk[:-1].reshape(batch, seq).copy(),
               "labels": chunk[1:].reshape(batch, seq).copy(),
               "loss_mask": np.ones((batch, seq), np.int32)}


def grads_bytes(unit_grads):
    return [g[k].tobytes() for g in unit_grads for k in sorted(g)]


def test_loss_falls_on_real_text():
    """50 AdamW steps of a tiny GPT-2 on standard-library source bring the loss well below log(257)."""
    model = build_model(TINY_GPT2)
    params = model.init_params(seed=0)
    opt = AdamW(lr=3e-3, weight_decay=0.01)
    state = {k: opt.init_state(v) for k, v in params.items()}
    batches = lm_batches(stdlib_tokens(), 16, 32)
    losses = [reference_step(model, params, state, opt, next(batches), micro_batch_size=4, step=t,
                             max_gradient_norm=1.0).loss for t in range(1, 51)]
    assert losses[0] == pytest.approx(np.log(257), abs=0.1)
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses


@pytest.mark.parametrize("groups", [2, 4])
def test_gradient_sum_splits_into_contiguous_groups(groups):
    """Partial sums over 2 or 4 contiguous groups of micro-batches, combined afterwards, give the same bits."""
    model = build_model(TINY_GPT2)
    params = model.init_params(seed=1)
    batch = next(lm_batches(stdlib_tokens(), 16, 32))
    batch["loss_mask"][3, :7] = 0
    whole = accumulate(model, params, batch, micro_batch_size=2)
    m = 8 // groups
    parts = [accumulate(model, params, batch, micro_batch_size=2, lo=g * m, hi=(g + 1) * m) for g in range(groups)]
    combined = tree_sum(parts, add=lambda a, b: (a[0] + b[0], a[1] + b[1],
                                                 [{k: x[k] + y[k] for k in x} for x, y in zip(a[2], b[2])]))
    assert combined[0] == whole[0] and combined[1] == whole[1] == 16 * 32 - 7
    assert grads_bytes(combined[2]) == grads_bytes(whole[2])


def test_same_seed_same_bits():
    def run():
        model = build_model(TINY_GPT2)
        params = model.init_params(seed=3)
        opt = AdamW(lr=1e-3)
        state = {k: opt.init_state(v) for k, v in params.items()}
        for t, b in zip(range(1, 4), lm_batches(stdlib_tokens(), 8, 32)):
            reference_step(model, params, state, opt, b, micro_batch_size=2, step=t)
        return [params[k].tobytes() for k in model.param_names]

    assert run() == run()


def test_tied_embedding_gradient_is_the_sum():
    """The tied wte gradient equals the embedding's plus the head's contribution."""
    model = build_model(dict(TINY_GPT2, num_hidden_layers=1))
    params = model.init_params(seed=4)
    batch = next(lm_batches(stdlib_tokens(), 2, 32))
    _, _, unit_grads, _ = model.forward_backward(params, batch)
    grads = model.combine_unit_grads(unit_grads)
    np.testing.assert_array_equal(grads["wte.weight"], unit_grads[0]["wte.weight"] + unit_grads[-1]["wte.weight"])


def test_a_batch_is_dealt_to_its_micro_batches_as_evenly_as_it_goes():
    """A power of two of micro-batches are the batch halved again and again (sizes within one of each
    other, and nodes of the tree over samples); another count, the first B mod count one larger."""
    assert MicroBatches(8, 2).ranges == MicroBatches(8, 2, num_csx=4).ranges == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert MicroBatches(6, 4).ranges == [(0, 3), (3, 6)]                        # 2 rounds of at most 4
    assert MicroBatches(9, 3, num_csx=2).ranges == [(0, 2), (2, 4), (4, 6), (6, 9)]
    assert MicroBatches(10, 4).ranges == [(0, 4), (4, 7), (7, 10)]              # 3: not halvings
    assert MicroBatches(9, 3, num_csx=2).aligned and not MicroBatches(10, 4).aligned
    assert MicroBatches(12, 3, num_csx=4).aligned and not MicroBatches(12, 4).aligned
    assert MicroBatches.even_sizes(673, 2)[-4:] == [85, 113, 169, 337]              # Cerebras' own example
    for args, match in [((6, 7), "micro_batch_size: 7 is not between 1 and the 6 samples of a CS-2"),
                        ((6, 1, 7), "batch_size: 6 samples cannot feed 7 CS-2s"),
                        ((3, 1, 2), "micro_batch_size: 1 makes 4 micro-batches of a batch of 3 samples")]:
        with pytest.raises(ValueError, match=match):
            MicroBatches(*args)
    model = build_model(TINY_GPT2)
    batch = next(lm_batches(stdlib_tokens(), 6, 32))
    loss, tokens, _, _ = accumulate(model, model.init_params(0), batch, micro_batch_size=4)
    assert tokens == 6 * 32 and loss > 0


LLAMA = {"name": "llama", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
         "filter_size": 48, "max_position_embeddings": 32, "attention_module": "multiquery_attention",
         "extra_attention_params": {"num_kv_groups": 2}, "share_embedding_weights": False}


def train(cfg, micro_batch_size, batch_size=16, steps=2):
    """(losses, weights' bytes) of ``steps`` reference steps (dropout on where ``cfg`` has it; a
    sample's tokens partly masked out)."""
    model = build_model(cfg)
    params = model.init_params(seed=0)
    opt = AdamW(lr=1e-3, weight_decay=0.01)
    state = {k: opt.init_state(v) for k, v in params.items()}
    losses = []
    for t, batch in zip(range(1, steps + 1), lm_batches(stdlib_tokens(), batch_size, 32)):
        batch["loss_mask"][3, :5] = 0
        losses.append(reference_step(model, params, state, opt, batch, micro_batch_size=micro_batch_size, step=t,
                                     seed=1, max_gradient_norm=1.0).loss)
    return losses, b"".join(params[k].tobytes() for k in model.param_names)


@pytest.mark.parametrize("cfg", [
    dict(TINY_GPT2, dropout_rate=0.1, attention_dropout_rate=0.1),
    dict(TINY_GPT2, mixed_precision=True, fp16_type="bfloat16"),
    dict(TINY_GPT2, mixed_precision=True, fp16_type="float16"),
    dict(TINY_GPT2, sparsity=0.5),
    dict(LLAMA, dropout_rate=0.1, mixed_precision=True, fp16_type="bfloat16"),
], ids=["gpt2-dropout", "gpt2-bfloat16", "gpt2-float16", "gpt2-sparse", "llama-gqa-bfloat16-dropout"])
def test_the_weights_have_the_same_bits_for_any_micro_batch_size(cfg):
    """Every sum over samples is the tree over the batch's samples (wse_core.nn.sample_tree), so micro-batches
    of 1, 2, 4, 8 and 16 samples of a batch of 16 train to the same bits, losses included; so do 3, 6
    and 12 of a batch of 12 (the sizes `auto` takes on 4, 2 and 1 CS-2s), halvings of it too."""
    first = train(cfg, 1)
    for size in (2, 4, 8, 16):
        assert train(cfg, size) == first, size
    twelve = train(cfg, 12, batch_size=12)
    assert train(cfg, 6, batch_size=12) == twelve and train(cfg, 3, batch_size=12) == twelve


@pytest.mark.parametrize("cfg", [{"activation": "relu"}, {"activation": "gelu", "sparsity": 0.5}], ids=["relu", "gelu-sparse"])
def test_an_mlps_weights_have_the_same_bits_for_any_micro_batch_size(cfg):
    """fc_mlp, whose sample is one row: each row's products are its own calls, so its weights too are the
    tree over samples' for micro-batches of 1, 2, 4, 8 and 16 samples."""
    model = build_model({"name": "fc_mlp", "input_size": 24, "hidden_sizes": [40, 16], "num_classes": 5, **cfg})
    rng = np.random.default_rng(0)
    batches = [{"features": rng.standard_normal((16, 24)).astype(np.float32),
                "labels": rng.integers(0, 5, 16).astype(np.int32)} for _ in range(2)]

    def run(size):
        params = model.init_params(seed=0)
        opt = AdamW(lr=1e-2)
        state = {k: opt.init_state(v) for k, v in params.items()}
        losses = [reference_step(model, params, state, opt, b, micro_batch_size=size, step=t).loss
                  for t, b in enumerate(batches, 1)]
        return losses, b"".join(params[k].tobytes() for k in model.param_names)

    first = run(1)
    assert all(run(size) == first for size in (2, 4, 8, 16))


def test_micro_batches_that_are_not_halvings_of_the_batch_have_bits_of_their_own():
    """Three micro-batches of 4 in a batch of 12 are not nodes of the tree over its samples (it halves
    12 into 6 and 6): the step's sums, in another order, differ in their last bits; `wse compile` and
    the params' notes say so (test_cli.py)."""
    assert not MicroBatches(12, 4).aligned
    assert train(TINY_GPT2, 4, batch_size=12, steps=1)[1] != train(TINY_GPT2, 12, batch_size=12, steps=1)[1]


def test_batch_errors_name_the_key():
    model = build_model(TINY_GPT2)
    params = model.init_params(0)
    opt = AdamW()
    state = {k: opt.init_state(v) for k, v in params.items()}
    batch = next(lm_batches(stdlib_tokens(), 2, 32))
    with pytest.raises(TypeError, match=r"batch\['labels'\]: expected an int32"):
        accumulate(model, params, dict(batch, labels=batch["labels"].astype(np.int64)), 1)
    long = {k: np.concatenate([v, v], axis=1) for k, v in batch.items()}
    with pytest.raises(ValueError, match="sequence length 64 exceeds model.max_position_embeddings 32"):
        accumulate(model, params, long, 1)
    with pytest.raises(ValueError, match="loss mask selects no token"):
        reference_step(model, params, state, opt, dict(batch, loss_mask=np.zeros_like(batch["loss_mask"])),
                       micro_batch_size=1, step=1)


@pytest.mark.parametrize("cfg,match", [
    (dict(TINY_GPT2, num_heads=5), "model.num_heads: 5 does not divide model.hidden_size 64"),
    (dict(TINY_GPT2, num_hidden_layers=0), "model.num_hidden_layers: expected an integer >= 1, got 0"),
    (dict(TINY_GPT2, hidden_size="big"), "model.hidden_size: expected an integer, got 'big'"),
    (dict(TINY_GPT2, dropout=0.1), "model.dropout: unknown key"),
    ({k: v for k, v in TINY_GPT2.items() if k != "vocab_size"}, "model.vocab_size: missing"),
    (dict(TINY_GPT2, layer_norm_epsilon=0), "model.layer_norm_epsilon: expected a number > 0"),
    (dict(TINY_GPT2, share_embedding_weights="yes"), "model.share_embedding_weights: expected true or false"),
    ({"name": "fc_mlp", "input_size": 4, "num_classes": 3, "activation": "swish"},
     "model.activation: unknown activation 'swish'"),
    ({"name": "fc_mlp", "input_size": 4, "num_classes": 3, "hidden_sizes": [8, 0]},
     r"model.hidden_sizes\[1\]: expected an integer >= 1, got 0"),
    ({"name": "bert"}, "model.name: unknown model 'bert'"),
])
def test_bad_model_configs_name_the_key(cfg, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build_model(cfg)


def test_loss_scaling_batch_size_with_loss_weight():
    """Model Zoo's ``loss_scaling: batch_size``: loss = sum / B * loss_weight, and the gradient with it.
    On a fully packed batch with loss_weight = 1 / seq it is the per-token mean, to the bit; with masked
    tokens it is not."""
    batch = next(lm_batches(stdlib_tokens(), 4, 32))
    runs = {}
    for scaling, extra in (("num_tokens", {}), ("batch_size", {"loss_weight": 1 / 32})):
        model = build_model(dict(TINY_GPT2, loss_scaling=scaling, **extra))
        params = model.init_params(0)
        opt = AdamW(lr=1e-3)
        state = {k: opt.init_state(v) for k, v in params.items()}
        r = reference_step(model, params, state, opt, batch, micro_batch_size=2, step=1, max_gradient_norm=1.0)
        runs[scaling] = (r, params)
    (a, pa), (b, pb) = runs["num_tokens"], runs["batch_size"]
    assert a.loss == b.loss and a.grad_norm == b.grad_norm
    assert all(pa[k].tobytes() == pb[k].tobytes() for k in pa)
    masked = dict(batch, loss_mask=batch["loss_mask"].copy())
    masked["loss_mask"][:, 20:] = 0
    model = build_model(dict(TINY_GPT2, loss_scaling="batch_size", loss_weight=0.5))
    params = model.init_params(0)
    loss_sum, n_tokens, _, _ = accumulate(model, params, masked, 2)
    opt = AdamW(lr=0.0)
    state = {k: opt.init_state(v) for k, v in params.items()}
    r = reference_step(model, params, state, opt, masked, micro_batch_size=2, step=1)
    assert n_tokens == 4 * 20 and r.loss == pytest.approx(loss_sum / 4 * 0.5, rel=1e-12)


@pytest.mark.parametrize("cfg,match", [
    ({"loss_scaling": "per_sample"}, "model.loss_scaling: expected num_tokens or batch_size"),
    ({"loss_weight": 0.5}, "model.loss_weight: 0.5 has no effect with loss_scaling: num_tokens"),
    ({"loss_scaling": "batch_size", "loss_weight": 0}, "model.loss_weight: expected a number > 0"),
])
def test_bad_loss_scaling_names_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_model(dict(TINY_GPT2, **cfg))
