"""gpt2 and gpt3 (``GPT2``: learned positions, LayerNorm, GELU, biases), and what the decoder
families share when built from the params: keys, initializers, muP's keys and scales."""
from wse_core.nn.config import GPT2Config
from wse_core.nn.init import resolve_initializer, scaled
from wse_core.nn.layers import Embedding, LMHead, TransformerBlock
from wse_core.nn.model import LanguageModel


class GPT2(LanguageModel):
    """gpt2 and gpt3: learned positions, LayerNorm, GELU, biases (HF: GPT2LMHeadModel)."""

    family = "gpt2"

    def _block_floats_per_token(self, h, f):
        return 8 * h + 2 * f  # x, ln_1, q, k, v, attention, mid, ln_2; fc pre-activation and activation


def build_gpt2(cfg, ops):
    """Model Zoo's gpt2 and gpt3: learned positions, LayerNorm, GELU (exact or tanh), biases; the head
    tied or not (``share_embedding_weights``); sparsity, dropout, initializers and muP as given."""
    c = GPT2Config.from_params(cfg)
    init = decoder_initializers(c)
    units = [Embedding(c.vocab_size, c.max_position_embeddings, c.hidden_size, ops, init["embedding"],
                       c.embedding_dropout_rate)]
    units += [TransformerBlock(i, c.hidden_size, c.num_heads, c.filter_size, c.layer_norm_epsilon,
                               c.num_hidden_layers, ops, 1.0 - c.sparsity, c.sparsity_seed, c.nonlinearity, init,
                               c.dropout_rate, c.attention_dropout_rate)
              for i in range(c.num_hidden_layers)]
    units.append(LMHead(c.hidden_size, c.vocab_size, c.layer_norm_epsilon, c.share_embedding_weights, ops,
                        init["embedding"], init["head"]))
    return GPT2(c.to_dict(), mup_scales(c, units), ops)


def mup_scales(c, units):
    """muP's model keys (Model Zoo 1.x spelling): ``embeddings_scale`` multiplies the embeddings,
    ``output_logits_scale`` the logits, ``scale_qk_dot_by_d`` divides q.k by the head size instead of
    its square root. They are set on the units (whose defaults change nothing)."""
    logits_scale = c.output_logits_scale or 1.0
    if c.mup_base_hidden_size:  # derived from the base width, as Model Zoo 2.3 does
        width = c.hidden_size / c.mup_base_hidden_size
        logits_scale = (c.output_logits_alpha or 1.0) / (width if c.scale_output_logits_by_d else width ** 0.5)
    units[0].scale, units[-1].logits_scale = c.embeddings_scale, logits_scale
    for unit in units[1:-1]:
        unit.scale_qk_dot_by_d = c.scale_qk_dot_by_d
    return units


def decoder_initializers(c):
    """Model Zoo's initializers of a decoder (docs/design/models.md "Initializers"): the default is
    truncated_normal(0, initializer_range, +-2 std); ``initializer`` sets q/k/v and fc (and the
    residual projections, unless ``output_layer_initializer`` does); the residual projections'
    default is the default scaled by 1/sqrt(2 layers); ``embedding_initializer`` sets both
    embeddings; an untied LM head is normal(0, initializer_range).

    muP (Model Zoo 2.3 on: ``mup_base_hidden_size`` and ``mup_base_filter_size``) scales them by the
    width and depth multipliers; the same bases scale the logits (``mup_scales``) and the decoder's
    learning rates (``Model.lr_factors``)."""
    std = c.initializer_range
    default = ("truncated_normal", 0.0, std, -2 * std, 2 * std)
    given = {k: resolve_initializer(getattr(c, k), f"model.{k}") for k in (
        "initializer", "embedding_initializer", "output_layer_initializer", "ffn_output_layer_initializer")
        if getattr(c, k) is not None}
    weight = given.get("initializer", default)
    if c.mup_base_hidden_size:
        width, filt = c.hidden_size / c.mup_base_hidden_size, c.filter_size / c.mup_base_filter_size
        depth = (2 * c.num_hidden_layers) ** -0.5
        weight = scaled(weight, width ** -0.5)
        output = scaled(given.get("output_layer_initializer", default), width ** -0.5 * depth)
        ffn_output = scaled(given.get("ffn_output_layer_initializer", default), filt ** -0.5 * depth)
    else:
        if "output_layer_initializer" in given:
            output = given["output_layer_initializer"]
        elif "initializer" in given:
            output = weight
        else:
            output = scaled(default, (2 * c.num_hidden_layers) ** -0.5)
        ffn_output = given.get("ffn_output_layer_initializer", output)
    return {"weight": weight, "output": output, "ffn_output": ffn_output,
            "embedding": given.get("embedding_initializer", default), "head": ("normal", 0.0, std)}
