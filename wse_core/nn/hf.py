"""Hugging Face names and configs for gpt2/gpt3 (GPT2LMHeadModel) and llama (LlamaForCausalLM).

``to_hf(config, weights)`` gives ``(config.json dict, {hf_name: array})``; ``from_hf(config_json,
tensors)`` gives ``(model config, weights)``; the round trip is exact (docs/design/checkpoints.md
"Hugging Face in and out"). Plain numpy: transformers itself is needed only to load what this writes.

- GPT-2: transformers' Conv1D keeps weights ``[in, out]``, so every projection is transposed.
- llama: wse-cluster (as Model Zoo) rotates adjacent pairs of a head's q/k features, transformers
  rotates its two halves; the q and k projection rows of each head are permuted to match (the
  permutation transformers' own LLaMA conversion applies), and back on the way in.
"""
import numpy as np

from wse_core.errors import ConfigError, DataError

_GELU = {"gelu": "gelu", "gelu_new": "gelu_new"}   # transformers' activation names for ours


def _pairs_to_halves(w, heads):
    """Rows of each head reordered from (x0, x1), (x2, x3), ... pairs to (x0, x2, ...), (x1, x3, ...) halves."""
    rows, cols = w.shape
    return np.ascontiguousarray(w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


def _halves_to_pairs(w, heads):
    rows, cols = w.shape
    return np.ascontiguousarray(w.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


def to_hf(config, weights):
    """(config.json, tensors) of a gpt2/gpt3/llama model config (``Model.config``) and its dense weights."""
    name = config["name"]
    L = config["num_hidden_layers"]
    if config.get("embeddings_scale", 1.0) != 1.0 or (config.get("output_logits_scale") or 1.0) != 1.0 \
            or config.get("scale_qk_dot_by_d") or config.get("mup_base_hidden_size"):
        raise ConfigError("model: muP's embeddings_scale, output_logits_scale and scale_qk_dot_by_d have no place in "
                          "transformers' GPT-2 and LLaMA configs")
    if name in ("gpt2", "gpt3"):
        cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config["vocab_size"],
               "n_positions": config["max_position_embeddings"], "n_ctx": config["max_position_embeddings"],
               "n_embd": config["hidden_size"], "n_layer": L, "n_head": config["num_heads"],
               "n_inner": config["filter_size"], "activation_function": _GELU[config["nonlinearity"]],
               "layer_norm_epsilon": config["layer_norm_epsilon"], "resid_pdrop": config["dropout_rate"],
               "embd_pdrop": config["embedding_dropout_rate"], "attn_pdrop": config["attention_dropout_rate"],
               "initializer_range": config["initializer_range"],
               "tie_word_embeddings": config["share_embedding_weights"], "torch_dtype": "float32"}
        out = {"transformer.wte.weight": weights["wte.weight"], "transformer.wpe.weight": weights["wpe.weight"],
               "transformer.ln_f.weight": weights["ln_f.weight"], "transformer.ln_f.bias": weights["ln_f.bias"]}
        for i in range(L):
            p, h = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
                out[h + theirs + ".weight"], out[h + theirs + ".bias"] = weights[p + ours + ".weight"], \
                    weights[p + ours + ".bias"]
            for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                                 ("mlp.proj", "mlp.c_proj")):
                out[h + theirs + ".weight"] = np.ascontiguousarray(weights[p + ours + ".weight"].T)
                out[h + theirs + ".bias"] = weights[p + ours + ".bias"]
        out["lm_head.weight"] = weights["wte.weight" if config["share_embedding_weights"] else "lm_head.weight"]
        return cfg, out
    if name != "llama":
        raise ConfigError(f"model.name: {name} has no Hugging Face counterpart here (gpt2, gpt3, llama have)")
    heads, kv = config["num_heads"], config["extra_attention_params"]["num_kv_groups"]
    head_dim = config["hidden_size"] // heads
    if config["rotary_dim"] != head_dim:
        raise ConfigError(f"model.rotary_dim: {config['rotary_dim']} is not the head size {head_dim}; "
                          "LlamaForCausalLM rotates whole heads")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config["vocab_size"],
           "hidden_size": config["hidden_size"], "intermediate_size": config["filter_size"],
           "num_hidden_layers": L, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
           "max_position_embeddings": config["max_position_embeddings"], "rms_norm_eps": config["layer_norm_epsilon"],
           "rope_theta": config["rope_theta"], "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
           "attention_dropout": config["attention_dropout_rate"], "initializer_range": config["initializer_range"],
           "tie_word_embeddings": config["share_embedding_weights"], "torch_dtype": "float32"}
    if config["pos_scaling_type"] == "llama3":
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": config["pos_scaling_factor"],
                               **config["pos_scaling_extra_args"]}
    elif config["pos_scaling_factor"] != 1.0:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": config["pos_scaling_factor"]}
    out = {"model.embed_tokens.weight": weights["wte.weight"], "model.norm.weight": weights["norm_f.weight"]}
    for i in range(L):
        p, h = f"blocks.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = weights[p + "norm_1.weight"]
        out[h + "post_attention_layernorm.weight"] = weights[p + "norm_2.weight"]
        out[h + "self_attn.q_proj.weight"] = _pairs_to_halves(weights[p + "attn.q.weight"], heads)
        out[h + "self_attn.k_proj.weight"] = _pairs_to_halves(weights[p + "attn.k.weight"], kv)
        out[h + "self_attn.v_proj.weight"] = weights[p + "attn.v.weight"]
        out[h + "self_attn.o_proj.weight"] = weights[p + "attn.proj.weight"]
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            out[h + f"mlp.{theirs}.weight"] = weights[p + f"mlp.{ours}.weight"]
    if not config["share_embedding_weights"]:
        out["lm_head.weight"] = weights["lm_head.weight"]
    return cfg, out


def _get(cfg, *keys, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def from_hf(cfg, tensors):
    """(model config for build_model, weights) of a GPT2LMHeadModel or LlamaForCausalLM directory's
    config.json and tensors; anything else is refused naming the key."""
    kind = cfg.get("model_type")
    f32 = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}

    def need(name):
        if name not in f32:
            raise DataError(f"model.safetensors: no tensor {name!r} (a {kind} checkpoint needs it)")
        return f32[name]

    if kind == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act not in _GELU:
            raise DataError(f"config.json: activation_function {act!r} is not built (gelu, gelu_new are)")
        L = cfg["n_layer"]
        tied = bool(cfg.get("tie_word_embeddings", True))
        model = {"name": "gpt2", "vocab_size": cfg["vocab_size"], "hidden_size": cfg["n_embd"], "num_hidden_layers": L,
                 "num_heads": cfg["n_head"], "filter_size": cfg.get("n_inner") or 4 * cfg["n_embd"],
                 "max_position_embeddings": cfg["n_positions"], "layer_norm_epsilon": cfg.get("layer_norm_epsilon", 1e-5),
                 "nonlinearity": act, "share_embedding_weights": tied,
                 "initializer_range": cfg.get("initializer_range", 0.02)}
        w = {"wte.weight": need("transformer.wte.weight"), "wpe.weight": need("transformer.wpe.weight"),
             "ln_f.weight": need("transformer.ln_f.weight"), "ln_f.bias": need("transformer.ln_f.bias")}
        for i in range(L):
            p, h = f"blocks.{i}.", f"transformer.h.{i}."
            for ln in ("ln_1", "ln_2"):
                w[p + ln + ".weight"], w[p + ln + ".bias"] = need(h + ln + ".weight"), need(h + ln + ".bias")
            for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                                 ("mlp.proj", "mlp.c_proj")):
                w[p + ours + ".weight"] = np.ascontiguousarray(need(h + theirs + ".weight").T)
                w[p + ours + ".bias"] = need(h + theirs + ".bias")
        if not tied:
            w["lm_head.weight"] = need("lm_head.weight")
        return model, w
    if kind != "llama":
        raise DataError(f"config.json: model_type {kind!r} is not built (gpt2 and llama are)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("hidden_act", "silu") != "silu":
        raise DataError("config.json: biases or an activation other than silu are not built for llama")
    heads, L = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads") or heads
    rope = dict(_get(cfg, "rope_parameters", "rope_scaling", default={}) or {})
    theta = _get(rope, "rope_theta", default=_get(cfg, "rope_theta", default=10000.0))
    model = {"name": "llama", "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
             "num_hidden_layers": L, "num_heads": heads, "filter_size": cfg["intermediate_size"],
             "max_position_embeddings": cfg["max_position_embeddings"], "layer_norm_epsilon": cfg.get("rms_norm_eps", 1e-6),
             "rope_theta": float(theta), "share_embedding_weights": bool(cfg.get("tie_word_embeddings", False)),
             "attention_module": "multiquery_attention", "extra_attention_params": {"num_kv_groups": kv},
             "initializer_range": cfg.get("initializer_range", 0.02)}
    kind_of_rope = rope.get("rope_type", rope.get("type", "default"))
    if kind_of_rope == "llama3":
        model.update(pos_scaling_type="llama3", pos_scaling_factor=float(rope["factor"]), pos_scaling_extra_args={
            k: rope[k] for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")})
    elif kind_of_rope == "linear":
        model.update(pos_scaling_type="linear", pos_scaling_factor=float(rope["factor"]))
    elif kind_of_rope != "default":
        raise DataError(f"config.json: rope scaling {kind_of_rope!r} is not built (linear and llama3 are)")
    w = {"wte.weight": need("model.embed_tokens.weight"), "norm_f.weight": need("model.norm.weight")}
    for i in range(L):
        p, h = f"blocks.{i}.", f"model.layers.{i}."
        w[p + "norm_1.weight"] = need(h + "input_layernorm.weight")
        w[p + "norm_2.weight"] = need(h + "post_attention_layernorm.weight")
        w[p + "attn.q.weight"] = _halves_to_pairs(need(h + "self_attn.q_proj.weight"), heads)
        w[p + "attn.k.weight"] = _halves_to_pairs(need(h + "self_attn.k_proj.weight"), kv)
        w[p + "attn.v.weight"] = need(h + "self_attn.v_proj.weight")
        w[p + "attn.proj.weight"] = need(h + "self_attn.o_proj.weight")
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            w[p + f"mlp.{ours}.weight"] = need(h + f"mlp.{theirs}.weight")
    if not model["share_embedding_weights"]:
        w["lm_head.weight"] = need("lm_head.weight")
    return model, w
