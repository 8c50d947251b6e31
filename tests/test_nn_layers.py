"""Every streaming unit and both models: forward against naive float64 numpy, gradients against finite differences."""
import math

import numpy as np
import pytest

from wse_core.models import build_model

from wse_core.nn import Dense, Embedding, LMHead, TransformerBlock
from wse_core.nn.layers import ATTENTION_OUT_SITE, ATTENTION_SITE, MLP_OUT_SITE, DropoutKey
from wse_core.nn.model import Model

H = 1e-5  # central-difference step (float64)


def init(unit, rng):
    """float64 parameters with non-trivial LayerNorm weights and biases."""
    model = Model({}, [unit])
    params = model.init_params(seed=int(rng.integers(1 << 30)), dtype=np.float64)
    for name, p in params.items():
        p += rng.standard_normal(p.shape) * (0.5 if p.ndim == 1 else 0.1)
    return params


def fd_check(f, arrays, analytic, rng, samples=6):
    """Compare analytic gradients with central differences of scalar f() at a few entries of each array."""
    for name, arr in arrays.items():
        flat = arr.reshape(-1)
        for i in rng.choice(flat.size, size=min(samples, flat.size), replace=False):
            old = flat[i]
            flat[i] = old + H
            up = f()
            flat[i] = old - H
            down = f()
            flat[i] = old
            num = (up - down) / (2 * H)
            ana = analytic[name].reshape(-1)[i]
            assert ana == pytest.approx(num, rel=1e-6, abs=1e-8), f"{name}[{i}]: analytic {ana}, numeric {num}"


def check_unit(unit, x, params, rng, drop=None):
    y, saved = unit.forward(x, params, drop)
    r = rng.standard_normal(y.shape)
    dx, grads = unit.backward(r, saved, params)
    f = lambda: float((unit.forward(x, params, drop)[0] * r).sum())  # noqa: E731
    fd_check(f, params, grads, rng)
    if dx is not None:
        fd_check(f, {"x": x}, {"x": dx}, rng)


# --- naive float64 references -------------------------------------------------------------------

def ref_layernorm(x, g, b, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * g + b


def ref_gelu(x, exact=True):
    """gelu by its definitions: exact (erf, element by element) or GPT-2's tanh approximation."""
    if exact:
        return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def ref_block(x, P, p, heads, eps, exact=True, masks=(None, None, None)):
    """masks: dropout scales of the attention weights [b, heads, t, t] and of the two residual
    branches [b, t, c] (None: no dropout)."""
    attn_mask, out_mask, mlp_mask = (np.ones(1) if m is None else m for m in masks)
    b, t, c = x.shape
    d = c // heads
    h = ref_layernorm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
    qkv = h @ P[p + "attn.qkv.weight"].T + P[p + "attn.qkv.bias"]
    out = np.zeros((b, t, c))
    for s in range(b):
        for hd in range(heads):
            q = qkv[s, :, hd * d:(hd + 1) * d]
            k = qkv[s, :, c + hd * d:c + (hd + 1) * d]
            v = qkv[s, :, 2 * c + hd * d:2 * c + (hd + 1) * d]
            scores = q @ k.T / math.sqrt(d)
            scores[np.triu(np.ones((t, t), bool), 1)] = -np.inf
            w = np.exp(scores - scores.max(1, keepdims=True))
            w /= w.sum(1, keepdims=True)
            w = w * (attn_mask if attn_mask.ndim == 1 else attn_mask[s, hd])
            out[s, :, hd * d:(hd + 1) * d] = w @ v
    x = x + (out @ P[p + "attn.proj.weight"].T + P[p + "attn.proj.bias"]) * out_mask
    h = ref_layernorm(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
    m = ref_gelu(h @ P[p + "mlp.fc.weight"].T + P[p + "mlp.fc.bias"], exact)
    return x + (m @ P[p + "mlp.proj.weight"].T + P[p + "mlp.proj.bias"]) * mlp_mask


# --- units ----------------------------------------------------------------------------------------

def test_embedding(rng):
    unit = Embedding(13, 9, 6)
    params = init(unit, rng)
    ids = rng.integers(0, 13, (3, 7)).astype(np.int32)
    y, _ = unit.forward(ids, params)
    np.testing.assert_allclose(y, params["wte.weight"][ids] + params["wpe.weight"][np.arange(7)], rtol=1e-15)
    check_unit(unit, ids, params, rng)


@pytest.mark.parametrize("nonlinearity", ["gelu", "gelu_new"])
def test_transformer_block(rng, nonlinearity):
    unit = TransformerBlock(2, hidden_size=8, num_heads=2, filter_size=12, eps=1e-5, num_layers=3,
                            nonlinearity=nonlinearity)
    params = init(unit, rng)
    x = rng.standard_normal((2, 5, 8))
    y, _ = unit.forward(x, params)
    ref = ref_block(x, params, "blocks.2.", 2, 1e-5, exact=nonlinearity == "gelu")
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    check_unit(unit, x, params, rng)


def test_dropout_is_keyed_by_sample_and_has_exact_gradients(rng):
    """Inverted dropout on the attention weights and both residual branches (and the embeddings):
    the forward equals the naive block with the same masks, gradients match finite differences,
    and a sample's masks depend on (seed, step, sample, layer, site) only, not on its micro-batch."""
    unit = TransformerBlock(2, hidden_size=8, num_heads=2, filter_size=12, eps=1e-5, num_layers=3,
                            dropout=0.3, attention_dropout=0.2)
    params = init(unit, rng)
    x = rng.standard_normal((3, 5, 8))
    drop = DropoutKey(seed=4, step=7, first_sample=10)
    masks = [drop.scale(3, 3, site, shape, rate, np.float64) for site, shape, rate in
             ((ATTENTION_SITE, (2, 5, 5), 0.2), (ATTENTION_OUT_SITE, (5, 8), 0.3), (MLP_OUT_SITE, (5, 8), 0.3))]
    assert {0.0, 1 / 0.7} == set(np.unique(masks[1])) and 0.2 < (masks[1] == 0).mean() < 0.4
    y, _ = unit.forward(x, params, drop)
    np.testing.assert_allclose(y, ref_block(x, params, "blocks.2.", 2, 1e-5, masks=masks), rtol=1e-12, atol=1e-12)
    assert not np.allclose(y, unit.forward(x, params)[0])  # no key: no dropout (evaluation)
    alone, _ = unit.forward(x[1:2], params, DropoutKey(seed=4, step=7, first_sample=11))
    assert alone.tobytes() == y[1:2].tobytes()
    other, _ = unit.forward(x, params, DropoutKey(seed=4, step=8, first_sample=10))
    assert not np.allclose(other, y)
    check_unit(unit, x, params, rng, drop)
    emb = Embedding(13, 9, 6, dropout=0.5)
    eparams = init(emb, rng)
    ids = rng.integers(0, 13, (3, 7)).astype(np.int32)
    h, _ = emb.forward(ids, eparams, drop)
    assert (h == 0).mean() > 0.3
    check_unit(emb, ids, eparams, rng, drop)


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head(rng, tied):
    unit = LMHead(8, 11, 1e-5, tied)
    params = init(unit, rng)
    x = rng.standard_normal((2, 4, 8))
    w = params["wte.weight" if tied else "lm_head.weight"]
    y, _ = unit.forward(x, params)
    ref = ref_layernorm(x, params["ln_f.weight"], params["ln_f.bias"], 1e-5) @ w.T
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    check_unit(unit, x, params, rng)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_new", None])
def test_dense(rng, activation):
    unit = Dense(0, 7, 5, activation)
    params = init(unit, rng)
    x = rng.standard_normal((6, 7))
    y, _ = unit.forward(x, params)
    lin = x @ params["layers.0.weight"].T + params["layers.0.bias"]
    ref = {"relu": np.maximum(lin, 0), "gelu": ref_gelu(lin), "gelu_new": ref_gelu(lin, exact=False),
           None: lin}[activation]
    np.testing.assert_allclose(y, ref, rtol=1e-13, atol=1e-14)
    check_unit(unit, x, params, rng)


def test_forward_does_not_touch_inputs(rng):
    unit = TransformerBlock(0, 8, 2, 16, 1e-5, 1)
    params = init(unit, rng)
    x = rng.standard_normal((2, 3, 8))
    before = {k: v.copy() for k, v in params.items()}, x.copy()
    y, saved = unit.forward(x, params)
    unit.backward(np.ones_like(y), saved, params)
    assert all(np.array_equal(before[0][k], params[k]) for k in params) and np.array_equal(before[1], x)


# --- whole models ---------------------------------------------------------------------------------

def lm_batch(rng, vocab, b, t, masked=True):
    ids = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    mask = (rng.random((b, t)) < 0.8).astype(np.int32) if masked else np.ones((b, t), np.int32)
    return {"input_ids": ids[:, :-1].copy(), "labels": ids[:, 1:].copy(), "loss_mask": mask}


def check_model(model, batch, rng, samples=3):
    params = model.init_params(seed=1, dtype=np.float64)
    for p in params.values():
        p += rng.standard_normal(p.shape) * 0.1
    loss, n, unit_grads, _ = model.forward_backward(params, batch)
    grads = model.combine_unit_grads(unit_grads)
    assert set(grads) == set(model.param_names)
    fd_check(lambda: model.forward_backward(params, batch)[0], params, grads, rng, samples)
    return loss, n


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_model_gradients(rng, tied):
    model = build_model({"name": "gpt2", "vocab_size": 11, "hidden_size": 8, "num_hidden_layers": 2,
                         "num_heads": 2, "max_position_embeddings": 6, "share_embedding_weights": tied})
    names = model.param_names
    assert ("lm_head.weight" in names) != tied and names.count("wte.weight") == 1
    batch = lm_batch(rng, 11, 3, 5)
    loss, n = check_model(model, batch, rng)
    assert n == int(batch["loss_mask"].sum())


LLAMA = {"name": "llama", "vocab_size": 13, "hidden_size": 16, "num_hidden_layers": 2, "num_heads": 4,
         "filter_size": 24, "max_position_embeddings": 8, "attention_module": "multiquery_attention",
         "extra_attention_params": {"num_kv_groups": 2}, "rope_theta": 500.0}


@pytest.mark.parametrize("variant", [{}, {"share_embedding_weights": False, "rotary_dim": 2},
                                     {"extra_attention_params": {"num_kv_groups": 1}, "pos_scaling_type": "llama3",
                                      "pos_scaling_factor": 8.0, "pos_scaling_extra_args": {
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 4}}],
                         ids=["gqa-tied", "untied-partial-rotary", "mqa-llama3-scaling"])
def test_llama_model_gradients(rng, variant):
    """RMSNorm, rotary positions, grouped-query attention, SwiGLU: float64 finite differences."""
    model = build_model(dict(LLAMA, **variant))
    assert "wpe.weight" not in model.param_names and model.param_specs["blocks.0.attn.k.weight"].shape == (
        16 // 4 * model.config["extra_attention_params"]["num_kv_groups"], 16)
    loss, n = check_model(model, lm_batch(rng, 13, 3, 6), rng, samples=4)
    assert math.isfinite(loss)


def test_llama_block_with_dropout_has_exact_gradients(rng):
    from wse_core.nn.llama import LlamaBlock, Rotary

    unit = LlamaBlock(1, 16, 4, 2, 24, 1e-5, Rotary(4, 4, 10000.0, 8), dropout=0.2, attention_dropout=0.3)
    params = init(unit, rng)
    check_unit(unit, rng.standard_normal((2, 5, 16)), params, rng, DropoutKey(seed=1, step=2, first_sample=3))


def test_llama_rotary_is_a_rotation_of_adjacent_pairs():
    """Pair (2i, 2i+1) at position t turns by t * theta^(-2i/d): relative positions survive in q.k."""
    from wse_core.nn.llama import Rotary

    rot = Rotary(4, 4, 100.0, 16)
    q = np.tile(np.array([1.0, 0.0, 1.0, 0.0]), (16, 1))
    r = rot.apply(q.copy())
    assert np.allclose(r[3], [math.cos(3), math.sin(3), math.cos(0.3), math.sin(0.3)])
    assert np.allclose((r[5] * r[2]).sum(), (r[7] * r[4]).sum())  # the dot product depends on 5 - 2 == 7 - 4
    assert np.allclose(rot.apply(r.copy(), inverse=True), q)
    with pytest.raises(ValueError, match="model.rotary_dim: expected an even number"):
        Rotary(4, 3, 100.0, 16)


@pytest.mark.parametrize("key,value,match", [
    ("use_ffn_bias", True, "model.use_ffn_bias: llama is built with False, got True"),
    ("norm_type", "layernorm", "model.norm_type: llama is built with 'rmsnorm'"),
    ("extra_attention_params", {"num_kv_groups": 3}, "num_kv_groups: 3 does not divide model.num_heads 4"),
    ("pos_scaling_type", "yarn", "model.pos_scaling_type: expected linear or llama3"),
    ("sparsity", 0.5, "model.sparsity: unknown key")])
def test_llama_refuses_what_it_does_not_build(key, value, match):
    with pytest.raises(ValueError, match=match):
        build_model(dict(LLAMA, **{key: value}))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_mup_scales_have_exact_gradients_and_lr_groups(rng, family):
    """muP's embeddings_scale, output_logits_scale and scale_qk_dot_by_d: float64 finite differences;
    adjust_learning_rate's groups (decoder_kernel is the three decoder groups)."""
    base = LLAMA if family == "llama" else {"name": "gpt2", "vocab_size": 13, "hidden_size": 16,
                                             "num_hidden_layers": 2, "num_heads": 4, "max_position_embeddings": 8}
    cfg = dict(base, embeddings_scale=10.0, output_logits_scale=0.25, scale_qk_dot_by_d=True)
    model = build_model(cfg)
    check_model(model, lm_batch(rng, 13, 3, 6), rng, samples=3)
    plain = build_model(base).init_params(1, np.float64)
    batch = lm_batch(rng, 13, 2, 5)
    assert not np.allclose(model.forward(plain, batch)[0], build_model(base).forward(plain, batch)[0])
    f = model.lr_factors({"decoder_kernel": 0.5, "embedding": 2.0})
    mlp_in = "blocks.1.mlp.up.weight" if family == "llama" else "blocks.1.mlp.fc.weight"
    assert f["wte.weight"] == 2.0 and f[mlp_in] == 0.5 and f["blocks.0.norm_1.weight" if family == "llama"
                                                             else "blocks.0.ln_1.bias"] == 1.0
    g = model.lr_factors({"decoder_attention": 0.25, "decoder_output_ffn": 4.0})
    assert g["blocks.0.attn.proj.weight"] == 0.25 and g[mlp_in] == 1.0
    with pytest.raises(ValueError, match="adjust_learning_rate.decoder: unknown group"):
        model.lr_factors({"decoder": 0.5})
    with pytest.raises(ValueError, match="in groups with different scales"):
        model.lr_factors({"decoder_kernel": 0.5, "decoder_attention": 0.25})


def test_mup_from_base_sizes():
    """Model Zoo 2.3's muP: hidden 64 over base 16 (width 4), filter 128 over base 64 (2): q/k/v and fc
    initializers scaled by 1/2, the attention and FFN output layers by width^-1/2 and filter^-1/2
    times 1/sqrt(2 layers), logits by alpha / width, learning rates by 1/4, 1/4 and 1/2."""
    base = {"name": "gpt2", "vocab_size": 50, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4,
            "filter_size": 128, "max_position_embeddings": 8, "initializer": {"name": "normal", "std": 0.08}}
    model = build_model(dict(base, mup_base_hidden_size=16, mup_base_filter_size=64, output_logits_alpha=2.0))
    specs = model.param_specs
    assert specs["blocks.0.attn.qkv.weight"].init == ("normal", 0.0, 0.04)
    assert specs["blocks.0.attn.proj.weight"].init[2] == pytest.approx(0.02 * 0.5 * 0.5)  # default 0.02 truncated
    assert specs["blocks.0.mlp.proj.weight"].init[2] == pytest.approx(0.02 * 2 ** -0.5 * 0.5)
    assert model.units[-1].logits_scale == 0.5 and model.units[1].scale_qk_dot_by_d is False
    f = model.lr_factors()
    assert (f["blocks.1.attn.qkv.weight"], f["blocks.1.mlp.fc.weight"], f["blocks.1.mlp.proj.weight"],
            f["wte.weight"]) == (0.25, 0.25, 0.5, 1.0)
    assert model.lr_factors({"decoder_output_ffn": 1.0})["blocks.1.mlp.proj.weight"] == 1.0  # the params override
    with pytest.raises(ValueError, match="needs both mup_base_hidden_size and mup_base_filter_size"):
        build_model(dict(base, mup_base_hidden_size=16))
    with pytest.raises(ValueError, match="output_logits_scale: given beside muP's base sizes"):
        build_model(dict(base, mup_base_hidden_size=16, mup_base_filter_size=64, output_logits_scale=0.5))


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_new"])
def test_fc_mlp_model_gradients(rng, activation):
    model = build_model({"name": "fc_mlp", "input_size": 6, "hidden_sizes": [5, 4], "num_classes": 3,
                         "activation": activation})
    assert model.param_names == [f"layers.{i}.{k}" for i in range(3) for k in ("weight", "bias")]
    batch = {"features": rng.standard_normal((7, 6)), "labels": rng.integers(0, 3, 7).astype(np.int32)}
    loss, n = check_model(model, batch, rng)
    assert n == 7


def test_correct_counts_masked_argmax_hits():
    model = build_model({"name": "gpt2", "vocab_size": 5, "hidden_size": 8, "num_hidden_layers": 1, "num_heads": 2,
                         "max_position_embeddings": 4})
    y = np.zeros((1, 3, 5), np.float32)
    y[0, 0, 2] = y[0, 1, 4] = y[0, 2, 1] = 1.0   # predicts 2, 4, 1
    batch = {"labels": np.array([[2, 3, 1]], np.int32), "loss_mask": np.array([[1, 1, 0]], np.int32)}
    assert model.correct(y, batch) == 1           # the third hit is masked out


def test_loss_matches_naive_cross_entropy(rng):
    model = build_model({"name": "gpt2", "vocab_size": 11, "hidden_size": 8, "num_hidden_layers": 1,
                         "num_heads": 2, "max_position_embeddings": 6})
    params = model.init_params(seed=2, dtype=np.float64)
    batch = lm_batch(rng, 11, 2, 6)
    logits, _ = model.forward(params, batch)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, batch["labels"][..., None].astype(np.int64), -1)[..., 0]
    want = -(picked * batch["loss_mask"]).sum()
    loss, n, _ = model.loss(logits.copy(), batch)
    assert loss == pytest.approx(want, rel=1e-12) and n == batch["loss_mask"].sum()


def test_gpt2_initialisation(rng):
    """Model Zoo's default: truncated_normal(0, 0.02, +-2 std), residual projections scaled by
    1/sqrt(2 layers) (bounds too), LayerNorm (1, 0), seeded; an initializer given by name is used."""
    cfg = {"name": "gpt2", "vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 8, "num_heads": 4,
           "max_position_embeddings": 64}
    p = build_model(cfg).init_params(seed=7)
    trunc = 0.02 * math.sqrt(1 - 4 * math.exp(-2) / math.sqrt(2 * math.pi) / math.erf(2 / math.sqrt(2)))
    assert p["wte.weight"].dtype == np.float32
    assert p["wte.weight"].std() == pytest.approx(trunc, rel=0.03) and np.abs(p["wte.weight"]).max() <= 0.04
    assert p["blocks.3.mlp.proj.weight"].std() == pytest.approx(trunc / 4, rel=0.05)
    assert np.abs(p["blocks.3.mlp.proj.weight"]).max() <= 0.04 / 4 < np.abs(p["blocks.3.mlp.fc.weight"]).max()
    assert np.all(p["blocks.0.ln_1.weight"] == 1) and np.all(p["blocks.0.attn.qkv.bias"] == 0)
    custom = build_model(dict(cfg, initializer={"name": "normal", "std": 0.1}, share_embedding_weights=False,
                              output_layer_initializer={"name": "uniform", "a": -0.3, "b": 0.3},
                              embedding_initializer={"name": "truncated_normal", "std": 0.05, "a": -0.01, "b": 0.08}))
    c = custom.init_params(seed=7)
    assert c["blocks.0.attn.qkv.weight"].std() == pytest.approx(0.1, rel=0.05)
    assert c["blocks.0.attn.proj.weight"].min() >= -0.3 and c["blocks.0.attn.proj.weight"].std() == pytest.approx(
        0.6 / math.sqrt(12), rel=0.05)
    assert c["wpe.weight"].min() >= -0.01 and c["wpe.weight"].max() <= 0.08 and c["wte.weight"].min() < -0.009
    assert c["lm_head.weight"].std() == pytest.approx(0.02, rel=0.05)  # untied head: normal(initializer_range)
    assert not custom.param_specs["blocks.0.ln_1.weight"].decay and custom.param_specs["lm_head.weight"].decay
    with pytest.raises(ValueError, match=r"model.initializer.name: expected one of normal, truncated_normal"):
        build_model(dict(cfg, initializer={"name": "orthogonal"}))
    with pytest.raises(ValueError, match=r"model.initializer: expected a < mean < b"):
        build_model(dict(cfg, initializer={"name": "truncated_normal", "std": 0.02, "a": 0.1}))
    q = build_model(cfg).init_params(seed=7)
    assert all(p[k].tobytes() == q[k].tobytes() for k in p)
    r = build_model(cfg).init_params(seed=8)
    assert not np.array_equal(p["wte.weight"], r["wte.weight"])
