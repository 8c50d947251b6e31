"""The model families' configs: ``GPT2Config`` (gpt2, gpt3), ``LlamaConfig``, ``MLPConfig`` and
``TorchConfig`` (a compiled PyTorch model), the
``model`` section of the params, written out as frozen dataclasses.

Each field carries its constraint and help (``wse_core.checks.key``); its Model Zoo fate is
"honoured". Model Zoo keys a family has no field for are in its ``ZOO`` mapping with their fate
(tuning, same value, not built), which ``pyapi.modelzoo.sort_keys`` reads: one place says what a
family takes. ``Config.from_params(mapping)`` checks a ``model`` section with the one validator
(``wse_core.checks.check_fields``), fills the defaults that follow from other keys and checks what
keys say of each other; ``to_dict()`` is the resolved section a run records (``Model.config``).
"""
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar

from wse_core.checks import (Bool, Check, Fixed, Int, ListOf, Number, OneOf, Text, Zoo, check_fields, key,
                             show)
from wse_core.errors import ConfigError, ConfigTypeError
from wse_core.nn.init import resolve_initializer
from wse_core.nn.precision import FORMATS

POSITIVE = Number(0, open="low")
RATE = Number(0, 1, open="high")

# wse-cluster's bounds on a model's sizes: far beyond any real model, so that an absurd size is one line
# at once (a million decoder blocks took minutes to lay out before anything failed). Real figures:
# Llama 3.1 405B has 126 blocks, widths up to 53,248 (its filter) and 131,072 positions; Gemma 256,000 tokens.
LAYERS = Int(1, 1_024, bound="wse-cluster's bound on layers (the deepest real models have about 130)")
WIDTH = Int(1, 1 << 20, bound="wse-cluster's bound on a width (the widest real layers have about 50,000)")
TOKENS = Int(1, 1 << 22, bound="wse-cluster's bound on a vocabulary (the largest real ones have about 256,000)")
POSITIONS = Int(1, 1 << 24, bound="wse-cluster's bound on positions (the longest real contexts are about 10^7)")


def _initializer(value, path):
    resolve_initializer(value, path)  # raises naming the key; the config keeps what was written
    return dict(value)


def _mapping(names):
    def check(value, path):
        if not isinstance(value, Mapping) or set(value) - set(names):
            raise ConfigError(f"{path}: expected {{{', '.join(f'{n}: ...' for n in names)}}}, got {show(value)}")
        return dict(value)
    return check


#: fc_mlp's activations: gelu is exact (erf), as Model Zoo's; gelu_new is the tanh approximation.
ACTIVATIONS = ("relu", "gelu", "gelu_new")
INITIALIZER = Check(_initializer, "an initializer: {name: normal | truncated_normal | uniform | ..., args}")

#: Model Zoo's model keys that tune a real system (every family).
TUNING = {k: Zoo.tuning() for k in ("allow_multireplica", "boundary_casting", "tf_summary", "attention_softmax_fp32",
                                     "fold_rope_consts", "precision_opt_level")}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What every family has: its name and its precision (Model Zoo's ``mixed_precision``/``fp16_type``)."""

    ZOO: ClassVar[dict] = TUNING

    name: str = key(Text(), "the model family")  # each family narrows it to its own names
    mixed_precision: bool = key(Bool(), "compute in a 16-bit format (weights and activations; float32 master "
                                "weights and sums)", False)
    fp16_type: str | None = key(OneOf(*FORMATS), "the 16-bit format when mixed_precision (float16 when not given)",
                                None)

    @classmethod
    def from_params(cls, section):
        """The config of a ``model`` section (a mapping): checked, defaults filled in."""
        if not isinstance(section, Mapping):
            raise ConfigTypeError(f"model: expected a mapping, got {type(section).__name__}")
        return cls(**check_fields(cls, section, "model"))

    def __post_init__(self):
        self._derive("fp16_type", (self.fp16_type or "float16") if self.mixed_precision else self.fp16_type)

    def _derive(self, name, value):
        object.__setattr__(self, name, value)

    def to_dict(self):
        """The resolved ``model`` section (plain data; ``from_params`` takes it back unchanged)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(ModelConfig):
    """What gpt2, gpt3 and llama share: sizes, embeddings, loss, initializers, dropout and muP."""

    vocab_size: int = key(TOKENS, "tokens in the vocabulary")
    hidden_size: int = key(WIDTH, "width of the residual stream")
    num_hidden_layers: int = key(LAYERS, "decoder blocks")
    num_heads: int = key(WIDTH, "attention heads (dividing hidden_size)")
    max_position_embeddings: int = key(POSITIONS, "longest sequence")
    layer_norm_epsilon: float = key(POSITIVE, "the norms' epsilon", 1e-5)
    share_embedding_weights: bool = key(Bool(), "the LM head is the token embedding (tied)", True)
    loss_scaling: str = key(OneOf("num_tokens", "batch_size"), "the loss is the sum over tokens divided by the "
                            "tokens (num_tokens) or by the batch size times loss_weight (batch_size)", "num_tokens")
    loss_weight: float = key(POSITIVE, "with loss_scaling: batch_size, the loss is multiplied by it", 1.0)
    initializer_range: float = key(POSITIVE, "std of the default initializer (truncated at 2 std)", 0.02)
    initializer: dict | None = key(INITIALIZER, "q/k/v and fc weights (and the residual projections unless "
                                   "output_layer_initializer is given)", None)
    embedding_initializer: dict | None = key(INITIALIZER, "token and position embeddings", None)
    output_layer_initializer: dict | None = key(INITIALIZER, "the residual projections (default: the default "
                                                "scaled by 1/sqrt(2 layers))", None)
    ffn_output_layer_initializer: dict | None = key(INITIALIZER, "the feed-forward output projection (default: "
                                                    "as output_layer_initializer)", None)
    dropout_rate: float = key(RATE, "dropout on the residual branches (Model Zoo's default is 0.1; here 0)", 0.0)
    attention_dropout_rate: float | None = key(RATE, "dropout on the attention weights (default: dropout_rate)",
                                               None)
    embedding_dropout_rate: float | None = key(RATE, "dropout on the embeddings (default: dropout_rate)", None)
    embeddings_scale: float = key(POSITIVE, "muP: the embeddings are multiplied by it", 1.0)
    output_logits_scale: float | None = key(POSITIVE, "muP: the logits are multiplied by it", None)
    scale_qk_dot_by_d: bool = key(Bool(), "muP: q.k divided by the head size, not its square root", False)
    mup_base_hidden_size: float | None = key(POSITIVE, "muP (with mup_base_filter_size): the base model's width",
                                             None)
    mup_base_filter_size: float | None = key(POSITIVE, "muP: the base model's feed-forward width", None)
    output_logits_alpha: float | None = key(POSITIVE, "muP: the logits' multiplier before the width's", None)
    scale_output_logits_by_d: bool = key(Bool(), "muP: the logits are divided by the width (else its square root)",
                                         True)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.num_heads: {self.num_heads} does not divide model.hidden_size {self.hidden_size}")
        if self.loss_scaling == "num_tokens" and self.loss_weight != 1.0:
            raise ConfigError(f"model.loss_weight: {show(self.loss_weight)} has no effect with loss_scaling: "
                              "num_tokens (Model Zoo ignores it too); remove it, or use loss_scaling: batch_size")
        if (self.mup_base_hidden_size is None) != (self.mup_base_filter_size is None):
            raise ConfigError("model.mup_base_hidden_size: muP needs both mup_base_hidden_size and "
                              "mup_base_filter_size")
        if self.mup_base_hidden_size is not None and self.output_logits_scale is not None:
            raise ConfigError("model.output_logits_scale: given beside muP's base sizes, which set it; give one")
        for name in ("attention_dropout_rate", "embedding_dropout_rate"):
            if getattr(self, name) is None:
                self._derive(name, self.dropout_rate)


#: Model Zoo's keys of a decoder that name what is always built here, and what is not.
_DECODER_ZOO = {
    **TUNING,
    "use_position_embedding": Zoo.same((True,), "no position embedding"),
    "fixed_sparse_attention": Zoo.same((None,), "fixed sparse attention"),
    "attention_sliding_window_length": Zoo.not_built("sliding-window attention"),
    "attention_sink_tokens": Zoo.not_built("attention sinks"),
}


@dataclass(frozen=True, kw_only=True)
class GPT2Config(DecoderConfig):
    """gpt2 and gpt3 (Model Zoo's gpt3 is the GPT-2 architecture in Cerebras-GPT's shapes): learned
    positions, LayerNorm, GELU, biases."""

    ZOO: ClassVar[dict] = {
        **_DECODER_ZOO,
        "norm_type": Zoo.same(("layernorm", None), "", "RMSNorm is llama's (model.name: llama), not gpt2's"),
        "position_embedding_type": Zoo.same(("learned",), "", "{value} position embeddings are not built for gpt2 "
                                            "(built: learned; rotary: model.name: llama)"),
        "attention_type": Zoo.same(("scaled_dot_product",), "unscaled (dot_product) attention"),
        "attention_module": Zoo.same(("aiayn_attention", "multiheaded_attention"), "multi-query attention"),
        "use_projection_bias_in_attention": Zoo.same((True,), "q/k/v projections without biases"),
        "use_ffn_bias_in_attention": Zoo.same((True,), "an attention output projection without bias"),
        "use_ffn_bias": Zoo.same((True,), "feed-forward layers without biases"),
        "use_bias_in_output": Zoo.same((False,), "a bias on the LM head"),
        "embedding_layer_norm": Zoo.same((False,), "a layer norm after the embeddings"),
        **{k: Zoo.not_built(f"{what} (built for llama, not gpt2)") for k, what in (
            ("rotary_dim", "rotary position embeddings"), ("rope_theta", "rotary position embeddings"),
            ("pos_scaling_factor", "position scaling"), ("pos_scaling_type", "position scaling"),
            ("pos_scaling_extra_args", "position scaling"), ("extra_attention_params", "grouped-query attention"))},
    }

    name: str = key(OneOf("gpt2", "gpt3"), "gpt2 or gpt3")
    filter_size: int | None = key(WIDTH, "feed-forward width (default: 4 hidden_size)", None)
    nonlinearity: str = key(OneOf("gelu", "gelu_new"), "gelu (exact, as Model Zoo by default) or gelu_new (GPT-2's "
                            "tanh approximation)", "gelu")
    sparsity: float = key(RATE, "fraction of zeros in each Linear weight (a fixed random mask)", 0.0)
    sparsity_seed: int = key(Int(0), "seed of the sparsity masks", 0)

    def __post_init__(self):
        if self.filter_size is None:
            self._derive("filter_size", 4 * self.hidden_size)
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    """llama: RMSNorm, rotary positions on adjacent pairs, SwiGLU, grouped-query attention, no biases.
    The keys Model Zoo gives llama to say what it is are fields with the one value built (``Fixed``)."""

    ZOO: ClassVar[dict] = _DECODER_ZOO

    name: str = key(OneOf("llama"), "llama")
    filter_size: int = key(WIDTH, "feed-forward width (SwiGLU's gate and up projections)")
    position_embedding_type: str = key(Fixed("rotary", "llama"), "rotary", "rotary")
    norm_type: str = key(Fixed("rmsnorm", "llama"), "rmsnorm", "rmsnorm")
    nonlinearity: str = key(Fixed("swiglu", "llama"), "swiglu", "swiglu")
    use_projection_bias_in_attention: bool = key(Fixed(False, "llama"), "false: no q/k/v biases", False)
    use_ffn_bias_in_attention: bool = key(Fixed(False, "llama"), "false: no attention output bias", False)
    use_ffn_bias: bool = key(Fixed(False, "llama"), "false: no feed-forward biases", False)
    use_bias_in_output: bool = key(Fixed(False, "llama"), "false: no LM head bias", False)
    embedding_layer_norm: bool = key(Fixed(False, "llama"), "false: no norm after the embeddings", False)
    attention_type: str = key(Fixed("scaled_dot_product", "llama"), "scaled_dot_product", "scaled_dot_product")
    attention_module: str = key(OneOf("aiayn_attention", "multiquery_attention"), "multiquery_attention for "
                                "grouped-query attention", "aiayn_attention")
    extra_attention_params: dict | None = key(Check(_mapping(("num_kv_groups",)), "{num_kv_groups: N}"),
                                              "{num_kv_groups: N} with multiquery_attention (default: num_heads)",
                                              None)
    rotary_dim: int | None = key(WIDTH, "dimensions of each head rotated (default: the head size)", None)
    rope_theta: float = key(POSITIVE, "the rotary base", 10000.0)
    pos_scaling_factor: float = key(POSITIVE, "position scaling factor", 1.0)
    pos_scaling_type: str = key(OneOf("linear", "llama3"), "linear or llama3 position scaling", "linear")
    pos_scaling_extra_args: dict | None = key(
        Check(_mapping(("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
              "llama3's scaling arguments"), "llama3: low_freq_factor, high_freq_factor, "
        "original_max_position_embeddings", None)

    def __post_init__(self):
        super().__post_init__()
        extra = self.extra_attention_params or {}
        kv = extra["num_kv_groups"] if self.attention_module == "multiquery_attention" and "num_kv_groups" in extra \
            else self.num_heads
        self._derive("extra_attention_params", {"num_kv_groups": WIDTH(kv, "model.extra_attention_params."
                                                                         "num_kv_groups")})
        if self.rotary_dim is None:
            self._derive("rotary_dim", self.hidden_size // self.num_heads)
        extra_args = self.pos_scaling_extra_args or None
        self._derive("pos_scaling_extra_args", extra_args)
        if self.pos_scaling_type == "llama3":
            need = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if set(extra_args or ()) != set(need):
                raise ConfigError(f"model.pos_scaling_extra_args: llama3 scaling needs exactly {', '.join(need)}, "
                                  f"got {show(extra_args or {})}")

    @property
    def position_scaling(self):
        """The rotary positions' scaling (None, or its type, factor and llama3's arguments)."""
        if self.pos_scaling_type == "llama3":
            return {"type": "llama3", "factor": self.pos_scaling_factor,
                    **{k: float(v) for k, v in self.pos_scaling_extra_args.items()}}
        if self.pos_scaling_factor != 1.0:
            return {"type": "linear", "factor": self.pos_scaling_factor}
        return None


@dataclass(frozen=True, kw_only=True)
class MLPConfig(ModelConfig):
    """fc_mlp: Dense layers of ``hidden_sizes`` with ``activation`` between them, then ``num_classes``."""

    name: str = key(OneOf("fc_mlp"), "fc_mlp")
    input_size: int = key(WIDTH, "features per sample")
    hidden_sizes: list = key(ListOf(WIDTH, expected="a list of integers"), "widths of the hidden layers",
                             factory=list)
    num_classes: int = key(Int(2, TOKENS.high, bound="wse-cluster's bound on classes (as on a vocabulary)"),
                           "classes (the last layer's width)")
    activation: str = key(OneOf(*ACTIVATIONS, noun="activation"), "between the layers: relu, gelu (exact, erf) or "
                          "gelu_new (tanh)", "relu")
    sparsity: float = key(RATE, "fraction of zeros in each Linear weight (a fixed random mask)", 0.0)
    sparsity_seed: int = key(Int(0), "seed of the sparsity masks", 0)

    def __post_init__(self):
        super().__post_init__()
        if len(self.hidden_sizes) + 1 > LAYERS.high:  # the Dense layers: one per hidden size, and the classes'
            raise ConfigError(f"model.hidden_sizes: {len(self.hidden_sizes):,} hidden layers and the last make more "
                              f"than {LAYERS.high:,}, {LAYERS.bound}")


@dataclass(frozen=True, kw_only=True)
class TorchConfig(ModelConfig):
    """torch: a user's own PyTorch model, compiled (``wse_core.compiler``): its streaming units, their
    weights and the loss are in the program file ``save_program`` wrote; ``mixed_precision`` and
    ``fp16_type`` as for every family."""

    ZOO: ClassVar[dict] = {}

    name: str = key(OneOf("torch"), "torch")
    program: str = key(Text(), "the compiled program (wse_core.compiler.save_program): units, loss, weights")


#: ``model.name`` -> its config class.
CONFIGS = {"gpt2": GPT2Config, "gpt3": GPT2Config, "llama": LlamaConfig, "fc_mlp": MLPConfig, "torch": TorchConfig}
