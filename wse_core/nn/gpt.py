"""gpt2 and gpt3 (``GPT2``: learned positions, LayerNorm, GELU, biases), and what the decoder
families share when built from the params: keys, initializers, muP's keys and scales."""
from wse_core._checks import show
from wse_core.nn.checks import (check_int, check_keys, check_loss_scaling, check_number, check_precision, check_rate,
                                check_sparsity)
from wse_core.nn.init import resolve_initializer, scaled
from wse_core.nn.layers import Embedding, LMHead, TransformerBlock
from wse_core.nn.model import LanguageModel


class GPT2(LanguageModel):
    """gpt2 and gpt3: learned positions, LayerNorm, GELU, biases (HF: GPT2LMHeadModel)."""

    family = "gpt2"

    def _block_floats_per_token(self, h, f):
        return 8 * h + 2 * f  # x, ln_1, q, k, v, attention, mid, ln_2; fc pre-activation and activation


#: The keys of a gpt2/gpt3 model section (llama's start from them).
GPT2_KEYS = {"name", "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "filter_size",
             "max_position_embeddings", "layer_norm_epsilon", "share_embedding_weights", "sparsity",
             "sparsity_seed", "nonlinearity", "loss_scaling", "loss_weight", "initializer_range", "initializer",
             "embedding_initializer", "output_layer_initializer", "dropout_rate", "attention_dropout_rate",
             "embedding_dropout_rate", "mixed_precision", "fp16_type", "embeddings_scale", "output_logits_scale",
             "scale_qk_dot_by_d", "mup_base_hidden_size", "mup_base_filter_size", "output_logits_alpha",
             "scale_output_logits_by_d", "ffn_output_layer_initializer"}


def build_gpt2(cfg, ops):
    """Model Zoo's gpt2 and gpt3: learned positions, LayerNorm, GELU (exact or tanh), biases; the head
    tied or not (``share_embedding_weights``); sparsity, dropout, initializers and muP as given."""
    check_keys(cfg, GPT2_KEYS)
    c = {"name": cfg["name"]}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "max_position_embeddings"):
        c[key] = check_int(cfg, key)
    c["filter_size"] = check_int(cfg, "filter_size") if "filter_size" in cfg else 4 * c["hidden_size"]
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"model.layer_norm_epsilon: expected a number > 0, got {show(eps)}")
    c["layer_norm_epsilon"] = float(eps)
    tied = cfg.get("share_embedding_weights", True)
    if not isinstance(tied, bool):
        raise TypeError(f"model.share_embedding_weights: expected true or false, got {show(tied)}")
    c["share_embedding_weights"] = tied
    if c["hidden_size"] % c["num_heads"]:
        raise ValueError(f"model.num_heads: {c['num_heads']} does not divide "
                         f"model.hidden_size {c['hidden_size']}")
    check_loss_scaling(cfg, c)
    act = cfg.get("nonlinearity", "gelu")
    if act not in ("gelu", "gelu_new"):
        raise ValueError(f"model.nonlinearity: {show(act)} is not built (built: gelu, the exact form Model Zoo "
                         "uses by default; gelu_new, GPT-2's tanh approximation)")
    c["nonlinearity"] = act
    density, seed = check_sparsity(cfg, c)
    check_precision(cfg, c)
    init = decoder_initializers(cfg, c)
    # Dropout (Model Zoo's keys): residual branches and, unless given, the embeddings and the
    # attention weights at dropout_rate. The default here is none; Model Zoo's is 0.1.
    c["dropout_rate"] = check_rate(cfg, "dropout_rate", 0.0)
    c["attention_dropout_rate"] = check_rate(cfg, "attention_dropout_rate", c["dropout_rate"])
    c["embedding_dropout_rate"] = check_rate(cfg, "embedding_dropout_rate", c["dropout_rate"])
    units = [Embedding(c["vocab_size"], c["max_position_embeddings"], c["hidden_size"], ops, init["embedding"],
                       c["embedding_dropout_rate"])]
    units += [TransformerBlock(i, c["hidden_size"], c["num_heads"], c["filter_size"], c["layer_norm_epsilon"],
                               c["num_hidden_layers"], ops, density, seed, act, init, c["dropout_rate"],
                               c["attention_dropout_rate"])
              for i in range(c["num_hidden_layers"])]
    units.append(LMHead(c["hidden_size"], c["vocab_size"], c["layer_norm_epsilon"], tied, ops, init["embedding"],
                        init["head"]))
    return GPT2(c, mup_scales(cfg, c, units), ops)


def mup_scales(cfg, c, units):
    """muP's model keys (Model Zoo 1.x spelling): ``embeddings_scale`` multiplies the embeddings,
    ``output_logits_scale`` the logits, ``scale_qk_dot_by_d`` divides q.k by the head size instead of
    its square root. They are set on the units (whose defaults change nothing)."""
    c["embeddings_scale"] = check_number(cfg, "embeddings_scale", 1.0)
    given = cfg.get("output_logits_scale")
    c["output_logits_scale"] = None if given is None else check_number(cfg, "output_logits_scale", 1.0)
    by_d = cfg.get("scale_qk_dot_by_d", False)
    if not isinstance(by_d, bool):
        raise TypeError(f"model.scale_qk_dot_by_d: expected true or false, got {show(by_d)}")
    c["scale_qk_dot_by_d"] = by_d
    logits_scale = c["output_logits_scale"] or 1.0
    if c["mup_base_hidden_size"]:  # derived from the base width, as Model Zoo 2.3 does
        width = c["hidden_size"] / c["mup_base_hidden_size"]
        logits_scale = (c["output_logits_alpha"] or 1.0) / (width if c["scale_output_logits_by_d"] else width ** 0.5)
    units[0].scale, units[-1].logits_scale = c["embeddings_scale"], logits_scale
    for unit in units[1:-1]:
        unit.scale_qk_dot_by_d = by_d
    return units


def decoder_initializers(cfg, c):
    """Model Zoo's initializers of a decoder (docs/design.md section 5): the default is
    truncated_normal(0, initializer_range, +-2 std); ``initializer`` sets q/k/v and fc (and the
    residual projections, unless ``output_layer_initializer`` does); the residual projections'
    default is the default scaled by 1/sqrt(2 layers); ``embedding_initializer`` sets both
    embeddings; an untied LM head is normal(0, initializer_range)."""
    std = cfg.get("initializer_range", 0.02)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not 0 < std < float("inf"):
        raise ValueError(f"model.initializer_range: expected a number > 0, got {show(std)}")
    c["initializer_range"] = float(std)
    default = ("truncated_normal", 0.0, c["initializer_range"], -2 * c["initializer_range"], 2 * c["initializer_range"])
    given = {}
    for key in ("initializer", "embedding_initializer", "output_layer_initializer", "ffn_output_layer_initializer"):
        c[key] = cfg.get(key)
        if c[key] is not None:
            given[key] = resolve_initializer(c[key], f"model.{key}")
            c[key] = dict(c[key])
    weight = given.get("initializer", default)
    bases = _mup_bases(cfg, c)
    if bases:  # muP (Model Zoo 2.3 on): initializers scaled by the width and depth multipliers
        width, filt = bases
        depth = (2 * c["num_hidden_layers"]) ** -0.5
        weight = scaled(weight, width ** -0.5)
        output = scaled(given.get("output_layer_initializer", default), width ** -0.5 * depth)
        ffn_output = scaled(given.get("ffn_output_layer_initializer", default), filt ** -0.5 * depth)
    else:
        if "output_layer_initializer" in given:
            output = given["output_layer_initializer"]
        elif "initializer" in given:
            output = weight
        else:
            output = scaled(default, (2 * c["num_hidden_layers"]) ** -0.5)
        ffn_output = given.get("ffn_output_layer_initializer", output)
    return {"weight": weight, "output": output, "ffn_output": ffn_output,
            "embedding": given.get("embedding_initializer", default), "head": ("normal", 0.0, c["initializer_range"])}


def _mup_bases(cfg, c):
    """muP's base sizes (Model Zoo 2.3 on: ``mup_base_hidden_size`` and ``mup_base_filter_size``, both
    or neither): (hidden / base, filter / base), or None. They scale the decoder's initializers, the
    logits (``output_logits_alpha`` / width, or / sqrt(width) without ``scale_output_logits_by_d``)
    and the decoder's learning rates (``Model.lr_factors``)."""
    hidden, filt = cfg.get("mup_base_hidden_size"), cfg.get("mup_base_filter_size")
    c["mup_base_hidden_size"], c["mup_base_filter_size"] = hidden, filt
    c["output_logits_alpha"] = check_number(cfg, "output_logits_alpha", 1.0) if cfg.get("output_logits_alpha") is not None \
        else None
    by_d = cfg.get("scale_output_logits_by_d", True)
    if not isinstance(by_d, bool):
        raise TypeError(f"model.scale_output_logits_by_d: expected true or false, got {show(by_d)}")
    c["scale_output_logits_by_d"] = by_d
    if hidden is None and filt is None:
        return None
    if hidden is None or filt is None:
        raise ValueError("model.mup_base_hidden_size: muP needs both mup_base_hidden_size and mup_base_filter_size")
    if cfg.get("output_logits_scale") is not None:
        raise ValueError("model.output_logits_scale: given beside muP's base sizes, which set it; give one")
    return c["hidden_size"] / check_number(cfg, "mup_base_hidden_size", 1.0), c["filter_size"] / check_number(
        cfg, "mup_base_filter_size", 1.0)
