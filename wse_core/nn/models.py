"""Models as ordered lists of streaming units, built from the plain values of the params' ``model`` section.

``build_model({"name": "gpt2", "vocab_size": 257, ...})`` returns a ``Model``; unknown keys and
bad values raise ``ValueError``/``TypeError`` naming the key (``model.num_heads: ...``).

Batches are dicts of arrays whose first axis is the sample; each model family (``GPT2``,
``Llama``: ``LanguageModel``; ``Classifier``) defines its own layout, loss and memory estimate.
"""
import zlib
from collections.abc import Mapping

import numpy as np

from wse_core._checks import did_you_mean, show
from wse_core.nn import ops as fused_ops
from wse_core.nn.layers import Dense, Embedding, LMHead, TransformerBlock
from wse_core.nn.precision import FORMATS, Precision

ACTIVATIONS = ("relu", "gelu", "gelu_new")  # gelu: exact (erf), as Model Zoo; gelu_new: tanh

#: Model Zoo's initializers by name, as ``model.initializer`` & co. spell them: their keys and defaults
#: (truncated_normal's a, b default to -2 std, +2 std, as Model Zoo's). A resolved initializer is a tuple
#: (name, *values in this order), the ``init`` of a ParamSpec.
INITIALIZERS = {"normal": {"mean": 0.0, "std": 0.05}, "truncated_normal": {"mean": 0.0, "std": 0.05, "a": None, "b": None},
                "uniform": {"a": -0.05, "b": 0.05}, "constant": {"val": 0.0}, "zeros": {}, "ones": {}}


def draw(init, shape, rng):
    """Values of a parameter initialised by ``init`` (a resolved tuple) from ``rng``, in float64.

    truncated_normal redraws the values outside [a, b] until none is (as torch's trunc_normal_ in
    distribution; not in bits, which depend on the generator)."""
    kind, *v = init
    if kind == "normal":
        return rng.normal(v[0], v[1], shape)
    if kind == "truncated_normal":
        mean, std, a, b = v
        x = rng.normal(mean, std, shape)
        bad = (x < a) | (x > b)
        while bad.any():
            x[bad] = rng.normal(mean, std, int(bad.sum()))
            bad = (x < a) | (x > b)
        return x
    if kind == "uniform":
        return rng.uniform(v[0], v[1], shape)
    return np.full(shape, {"zeros": 0.0, "ones": 1.0}.get(kind, v[0] if v else 0.0))


def resolve_initializer(value, key):
    """A ``model.*initializer`` mapping (``{name: truncated_normal, std: 0.02}``) as a resolved tuple."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{key}: expected a mapping with a name (one of {', '.join(INITIALIZERS)}), got {show(value)}")
    name = value.get("name")
    if name not in INITIALIZERS:
        raise ValueError(f"{key}.name: expected one of {', '.join(INITIALIZERS)}, got {show(name)}")
    args = dict(INITIALIZERS[name])
    for k, v in value.items():
        if k == "name":
            continue
        if k not in args:
            raise ValueError(f"{key}.{k}: not a key of {name} (keys: {', '.join(args) or 'none'})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise ValueError(f"{key}.{k}: expected a number, got {show(v)}")
        args[k] = float(v)
    if name in ("normal", "truncated_normal") and not args["std"] > 0:
        raise ValueError(f"{key}.std: expected a number > 0, got {show(args['std'])}")
    if name == "truncated_normal":
        args["a"] = -2 * args["std"] if args["a"] is None else args["a"]
        args["b"] = 2 * args["std"] if args["b"] is None else args["b"]
        if not args["a"] < args["mean"] < args["b"]:
            raise ValueError(f"{key}: expected a < mean < b, got a={args['a']:g}, mean={args['mean']:g}, b={args['b']:g}")
    if name == "uniform" and not args["a"] < args["b"]:
        raise ValueError(f"{key}: expected a < b, got a={args['a']:g}, b={args['b']:g}")
    return (name, *args.values())


def scaled(init, factor):
    """``init`` with its spread (std and bounds) multiplied by ``factor`` (Model Zoo's depth scaling)."""
    kind, *v = init
    if kind == "normal":
        return (kind, v[0], v[1] * factor)
    if kind == "truncated_normal":
        return (kind, v[0], v[1] * factor, v[2] * factor, v[3] * factor)
    return init


class Model:
    """An ordered list of streaming units plus the loss on the last unit's output.

    A model family (``LanguageModel``: ``GPT2``, ``Llama``; ``Classifier``) adds its batch layout,
    its loss, its accuracy, its memory estimate and its Hugging Face names; this base class holds
    what every family shares: parameters, initialisation, the units' passes in the run's precision.
    """

    family = "model"
    is_lm = False

    def __init__(self, config, units, ops=fused_ops):
        self.config, self.units, self.ops = dict(config), list(units), ops
        self.precision = Precision(config.get("fp16_type") if config.get("mixed_precision") else None)
        self.param_specs = {}
        self.unit_params = []
        for unit in self.units:
            specs = unit.param_specs()
            for name, spec in specs.items():
                if self.param_specs.setdefault(name, spec) != spec:
                    raise ValueError(f"parameter {name}: units disagree on its shape or initialisation")
            self.unit_params.append(list(specs))

    @property
    def structures(self):
        """``{name: CSRMatrix}``: the fixed pattern of every sparse weight (whose parameter is its nonzeros)."""
        return {n: s.structure for n, s in self.param_specs.items() if s.structure is not None}

    @property
    def param_names(self):
        """Every parameter name once, in unit order (the order of updates and of the gradient norm)."""
        return list(self.param_specs)

    def num_params(self):
        return sum(int(np.prod(s.shape)) for s in self.param_specs.values())

    def unit_bytes(self, itemsize=4):
        """Bytes of each unit's own parameters (a shared parameter counts for its first unit only)."""
        seen, out = set(), []
        for names in self.unit_params:
            own = [n for n in names if n not in seen]
            seen.update(own)
            out.append(sum(int(np.prod(self.param_specs[n].shape)) for n in own) * itemsize)
        return out

    def init_params(self, seed, dtype=np.float32, names=None):
        """Initial parameters (all, or ``names``); each drawn from its own stream keyed by (seed, name), in float64, then cast.

        Keyed streams let every MemoryX rank initialise just the parameters it owns, with the same bits.
        """
        params = {}
        for name in (self.param_names if names is None else names):
            spec = self.param_specs[name]
            rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
            params[name] = np.ascontiguousarray(draw(spec.init, spec.shape, rng), dtype=dtype)
        return params

    def lr_factors(self, adjust=None):
        """{name: factor} of ``optimizer.adjust_learning_rate`` ({group: scale}; groups: ``LR_GROUPS``):
        each parameter's learning rate is the schedule's times its group's scale (1 outside every
        group). A parameter in two groups with different scales is refused."""
        adjust = {**self._mup_lr_scales(), **dict(adjust or {})}
        for group in adjust:
            if group not in LR_GROUPS:
                raise ValueError(f"optimizer.adjust_learning_rate.{group}: unknown group (known: {', '.join(LR_GROUPS)})")
        factors = {}
        for name, spec in self.param_specs.items():
            g = spec.lr_group
            scales = {adjust[k] for k in adjust if g is not None and (k == g or (k == "decoder_kernel"
                                                                                 and g.startswith("decoder_")))}
            if len(scales) > 1:
                raise ValueError(f"optimizer.adjust_learning_rate: {name} is in groups with different scales {sorted(scales)}")
            factors[name] = float(scales.pop()) if scales else 1.0
        return factors

    def _mup_lr_scales(self):
        """muP's learning-rate scales from its base sizes (1 / width for attention and the input FFN,
        1 / filter width for the output FFN), which ``adjust_learning_rate`` may override by group."""
        c = self.config
        if not c.get("mup_base_hidden_size"):
            return {}
        width, filt = c["hidden_size"] / c["mup_base_hidden_size"], c["filter_size"] / c["mup_base_filter_size"]
        return {"decoder_attention": 1 / width, "decoder_input_ffn": 1 / width, "decoder_output_ffn": 1 / filt}

    # -- what a family defines ------------------------------------------------------------------

    def activation_floats(self, samples, seq_len=None):
        """Floats the units keep from forward to backward for ``samples`` samples (an estimate from the layer code)."""
        raise NotImplementedError

    def example_layout(self, n, seq_len=None):
        """[(shape, dtype)] of ``n`` examples as a dataset and the wire hold them."""
        raise NotImplementedError

    def check_batch(self, batch):
        """Raise a ValueError/TypeError naming the key if ``batch`` does not fit this model; return its size."""
        raise NotImplementedError

    def batch_of(self, arrays):
        """The batch dict of examples as ``example_layout`` lays them out."""
        raise NotImplementedError

    def first_input(self, batch, dtype):
        raise NotImplementedError

    def correct(self, y, batch):
        """How many counted tokens (samples) the output ``y`` predicts right (argmax = label)."""
        raise NotImplementedError

    def _cross_entropy(self, y, batch):
        """(loss_sum, counted, dy) of the family's loss."""
        raise NotImplementedError

    @staticmethod
    def slice_batch(batch, lo, hi):
        return {k: v[lo:hi] for k, v in batch.items()}

    def loss_divisor(self, n_tokens, batch_size):
        """What the summed loss of a global batch is divided by (Model Zoo's ``model.loss_scaling``):
        the masked-in tokens (``num_tokens``), or the samples over ``loss_weight`` (``batch_size``:
        loss = sum / batch_size * loss_weight). The gradient, its norm and the logged loss use it."""
        if self.config.get("loss_scaling", "num_tokens") == "batch_size":
            return batch_size / self.config["loss_weight"]
        return n_tokens

    def loss(self, y, batch, loss_scale=1.0):
        """(loss_sum, n_tokens, dy): the family's cross-entropy summed over the batch (in float32) and
        its gradient times ``loss_scale``, in the run's precision (``optim.loss_scale``). ``y`` is
        overwritten (with dy)."""
        loss_sum, n, dy = self._cross_entropy(y, batch)
        if loss_scale != 1.0:
            dy *= np.float32(loss_scale)
        return loss_sum, n, self.precision.round_(dy)

    # -- one micro-batch ------------------------------------------------------------------------

    def forward(self, params, batch, drop=None):
        """Output of the last unit (logits) and what each unit saved for its backward pass; ``drop``
        (a ``DropoutKey``) turns dropout on (training), None leaves it off (evaluation)."""
        dtype = params[self.param_names[0]].dtype
        x = self.first_input(batch, dtype)
        saved = []
        for u in range(len(self.units)):
            x, s = self.unit_forward(u, x, params, drop)
            saved.append(s)
        return x, saved

    def compute_weights(self, params):
        """The weights the CS-2s compute with: ``params`` (float32 master weights) in the run's precision."""
        if self.precision.format is None:
            return params
        return {k: self.precision.format.round(v) for k, v in params.items()}

    def unit_forward(self, u, x, params, drop=None):
        """Unit u's forward; its output leaves in the run's precision (docs/design.md section 5)."""
        y, saved = self.units[u].forward(x, params, drop)
        return self.precision.round_(y), saved

    def unit_backward(self, u, dy, saved, params):
        """Unit u's backward; its input gradient and weight gradients in the run's precision."""
        with np.errstate(over="ignore", invalid="ignore"):  # a loss scale too big overflows: it is detected later
            dx, grads = self.units[u].backward(dy, saved, params)
        for g in grads.values():
            self.precision.round_(g)
        return (dx if dx is None else self.precision.round_(dx)), grads

    def forward_backward(self, params, batch, drop=None, loss_scale=1.0):
        """(loss_sum, n_tokens, unit_grads) for one micro-batch; unit_grads[i] holds unit i's gradients
        (of the loss times ``loss_scale``)."""
        y, saved = self.forward(params, batch, drop)
        loss_sum, n_tokens, dy = self.loss(y, batch, loss_scale)
        unit_grads = [None] * len(self.units)
        for i in reversed(range(len(self.units))):
            dy, unit_grads[i] = self.unit_backward(i, dy, saved[i], params)
            saved[i] = None  # free activations as soon as the unit is done
        return loss_sum, n_tokens, unit_grads

    def add_grads(self, a, b):
        """{name: a + b} of two gradient dicts, each sum in the run's precision (every partial sum of
        gradients, wherever it is made, is one of these)."""
        return {k: self.precision.add(a[k], b[k]) for k in a}

    def combine_unit_grads(self, unit_grads):
        """One gradient per parameter: a parameter used by several units gets their sum, in unit order."""
        grads = {}
        for g in unit_grads:
            for name, value in g.items():
                grads[name] = value if name not in grads else self.precision.add(grads[name], value)
        return grads


class LanguageModel(Model):
    """A decoder language model: batches of int32 ``input_ids``, ``labels``, ``loss_mask`` ``[B, T]``
    (T <= max_position_embeddings), stored as ``[n, 3, T]``; masked next-token cross-entropy."""

    is_lm = True

    def example_layout(self, n, seq_len=None):
        return [((n, 3, seq_len or self.config["max_position_embeddings"]), np.int32)]

    def check_batch(self, batch):
        cfg = self.config
        ids = batch.get("input_ids")
        for key in ("input_ids", "labels", "loss_mask"):
            a = batch.get(key)
            if not isinstance(a, np.ndarray) or a.dtype != np.int32 or a.ndim != 2:
                raise TypeError(f"batch[{key!r}]: expected an int32 [batch, seq] array, got "
                                f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
            if a.shape != ids.shape:
                raise ValueError(f"batch[{key!r}]: expected shape {ids.shape}, got {a.shape}")
        if ids.shape[1] > cfg["max_position_embeddings"]:
            raise ValueError(f"batch['input_ids']: sequence length {ids.shape[1]} exceeds "
                             f"model.max_position_embeddings {cfg['max_position_embeddings']}")
        if ids.size and (ids.min() < 0 or ids.max() >= cfg["vocab_size"]):
            raise ValueError(f"batch['input_ids']: ids must be in [0, {cfg['vocab_size']}), "
                             f"got {ids.min()}..{ids.max()}")
        return ids.shape[0]

    def batch_of(self, arrays):
        a = arrays[0] if isinstance(arrays, (list, tuple)) else arrays
        batch = {"input_ids": np.ascontiguousarray(a[:, 0]), "loss_mask": np.ascontiguousarray(a[:, 1]),
                 "labels": np.ascontiguousarray(a[:, 2])}
        # Data of another vocabulary would index past the embedding table: say so, not IndexError.
        v, ids = self.config["vocab_size"], batch["input_ids"]
        labels = batch["labels"][batch["loss_mask"] != 0]
        for name, x in (("input id", ids), ("label", labels)):
            if x.size and (x.min() < 0 or x.max() >= v):
                bad = int(x.max()) if x.max() >= v else int(x.min())
                raise ValueError(f"{name} {bad} outside the model's vocabulary [0, {v}) (model.vocab_size): the data "
                                 "was tokenized with another vocabulary")
        return batch

    def first_input(self, batch, dtype):
        return np.ascontiguousarray(batch["input_ids"])

    def correct(self, y, batch):
        hit = np.argmax(y, axis=-1) == batch["labels"]
        return int(np.count_nonzero(hit & (batch["loss_mask"] != 0)))

    def _cross_entropy(self, y, batch):
        b, t, v = y.shape
        mask = np.ascontiguousarray(batch["loss_mask"]).reshape(-1)
        loss_sum, dy = self.ops.cross_entropy(y.reshape(b * t, v), np.ascontiguousarray(batch["labels"]).reshape(-1),
                                              mask)
        return loss_sum, int(np.count_nonzero(mask)), dy.reshape(b, t, v)

    def activation_floats(self, samples, seq_len=None):
        c = self.config
        t = seq_len or c["max_position_embeddings"]
        per_block = t * self._block_floats_per_token(c["hidden_size"], c["filter_size"]) + c["num_heads"] * t * t
        head = t * (2 * c["hidden_size"] + c["vocab_size"])  # x, the final norm; logits
        return samples * (c["num_hidden_layers"] * per_block + head)

    def _block_floats_per_token(self, h, f):
        """Floats a decoder block keeps per token for its backward pass (besides the attention probabilities)."""
        raise NotImplementedError

    def to_hf(self, weights):
        """(config.json, tensors) for transformers (``wse_core.nn.hf``)."""
        from wse_core.nn.hf import to_hf

        return to_hf(self.config, weights)


class GPT2(LanguageModel):
    """gpt2 and gpt3: learned positions, LayerNorm, GELU, biases (HF: GPT2LMHeadModel)."""

    family = "gpt2"

    def _block_floats_per_token(self, h, f):
        return 8 * h + 2 * f  # x, ln_1, q, k, v, attention, mid, ln_2; fc pre-activation and activation


class Llama(LanguageModel):
    """llama: rotary positions, RMSNorm, grouped-query attention, SwiGLU (HF: LlamaForCausalLM)."""

    family = "llama"

    def _block_floats_per_token(self, h, f):
        return 7 * h + 4 * f  # x, norm_1, q, k and v (for every head), attention, mid, norm_2; gate, up, silu, product


class Classifier(Model):
    """fc_mlp: batches of float ``features`` ``[B, input_size]`` and int32 ``labels`` ``[B]`` (every sample counts)."""

    family = "fc_mlp"

    def activation_floats(self, samples, seq_len=None):
        c = self.config
        sizes = [c["input_size"], *c["hidden_sizes"], c["num_classes"]]
        return samples * sum(sizes[i] + sizes[i + 1] for i in range(len(sizes) - 1))

    def example_layout(self, n, seq_len=None):
        return [((n, self.config["input_size"]), np.float32), ((n,), np.int32)]

    def check_batch(self, batch):
        cfg = self.config
        x, y = batch.get("features"), batch.get("labels")
        if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != cfg["input_size"]:
            raise ValueError(f"batch['features']: expected [batch, {cfg['input_size']}], "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
        if not isinstance(y, np.ndarray) or y.dtype != np.int32 or y.shape != (x.shape[0],):
            raise TypeError(f"batch['labels']: expected int32 [{x.shape[0]}], got "
                            f"{getattr(y, 'dtype', type(y).__name__)} {getattr(y, 'shape', '')}")
        return x.shape[0]

    def batch_of(self, arrays):
        return {"features": arrays[0], "labels": arrays[1]}

    def first_input(self, batch, dtype):
        return self.precision.round_(np.array(batch["features"], dtype=dtype))

    def correct(self, y, batch):
        return int(np.count_nonzero(np.argmax(y, axis=-1) == batch["labels"]))

    def _cross_entropy(self, y, batch):
        loss_sum, dy = self.ops.cross_entropy(y, np.ascontiguousarray(batch["labels"]), np.ones(y.shape[0], np.int32))
        return loss_sum, y.shape[0], dy


# -- building from the params --------------------------------------------------------------------

_GPT2_KEYS = {"name", "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "filter_size",
              "max_position_embeddings", "layer_norm_epsilon", "share_embedding_weights", "sparsity",
              "sparsity_seed", "nonlinearity", "loss_scaling", "loss_weight", "initializer_range", "initializer",
              "embedding_initializer", "output_layer_initializer", "dropout_rate", "attention_dropout_rate",
              "embedding_dropout_rate", "mixed_precision", "fp16_type", "embeddings_scale", "output_logits_scale",
              "scale_qk_dot_by_d", "mup_base_hidden_size", "mup_base_filter_size", "output_logits_alpha",
              "scale_output_logits_by_d", "ffn_output_layer_initializer"}
_MLP_KEYS = {"name", "input_size", "hidden_sizes", "num_classes", "activation", "sparsity", "sparsity_seed",
             "mixed_precision", "fp16_type"}


def _int(cfg, key, low=1):
    v = cfg.get(key)
    if v is None:
        raise ValueError(f"model.{key}: missing")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"model.{key}: expected an integer, got {show(v)}")
    if v < low:
        raise ValueError(f"model.{key}: expected an integer >= {low}, got {v}")
    return int(v)


def _sparsity(cfg, c):
    """model.sparsity (fraction of zeros in each Linear weight, 0 <= s < 1) and model.sparsity_seed."""
    s = cfg.get("sparsity", 0.0)
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < 1:
        raise ValueError(f"model.sparsity: expected a number in [0, 1), got {show(s)}")
    c["sparsity"] = float(s)
    c["sparsity_seed"] = _int(cfg, "sparsity_seed", low=0) if "sparsity_seed" in cfg else 0
    return 1.0 - c["sparsity"], c["sparsity_seed"]


def _check_keys(cfg, known):
    for key in cfg:
        if key not in known:
            raise ValueError(f"model.{key}: unknown key ({did_you_mean(key, sorted(known))})")


def build_model(cfg, ops=fused_ops):
    """Build a ``Model`` from the ``model`` section of the params (a plain dict)."""
    if not isinstance(cfg, Mapping):
        raise TypeError(f"model: expected a mapping, got {type(cfg).__name__}")
    name = cfg.get("name")
    if name in ("gpt2", "gpt3"):  # Model Zoo's gpt3 is the GPT-2 architecture in Cerebras-GPT's shapes
        return _build_gpt2(cfg, ops)
    if name == "fc_mlp":
        return _build_fc_mlp(cfg, ops)
    if name == "llama":
        return _build_llama(cfg, ops)
    known = ("gpt2", "gpt3", "llama", "fc_mlp")
    raise ValueError(f"model.name: unknown model {show(name)} ({did_you_mean(name, known)})")


def _build_gpt2(cfg, ops):
    _check_keys(cfg, _GPT2_KEYS)
    c = {"name": cfg["name"]}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "max_position_embeddings"):
        c[key] = _int(cfg, key)
    c["filter_size"] = _int(cfg, "filter_size") if "filter_size" in cfg else 4 * c["hidden_size"]
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
    _loss_scaling(cfg, c)
    act = cfg.get("nonlinearity", "gelu")
    if act not in ("gelu", "gelu_new"):
        raise ValueError(f"model.nonlinearity: {show(act)} is not built (built: gelu, the exact form Model Zoo "
                         "uses by default; gelu_new, GPT-2's tanh approximation)")
    c["nonlinearity"] = act
    density, seed = _sparsity(cfg, c)
    _precision(cfg, c)
    init = _decoder_initializers(cfg, c)
    # Dropout (Model Zoo's keys): residual branches and, unless given, the embeddings and the
    # attention weights at dropout_rate. The default here is none; Model Zoo's is 0.1.
    c["dropout_rate"] = _rate(cfg, "dropout_rate", 0.0)
    c["attention_dropout_rate"] = _rate(cfg, "attention_dropout_rate", c["dropout_rate"])
    c["embedding_dropout_rate"] = _rate(cfg, "embedding_dropout_rate", c["dropout_rate"])
    units = [Embedding(c["vocab_size"], c["max_position_embeddings"], c["hidden_size"], ops, init["embedding"],
                       c["embedding_dropout_rate"])]
    units += [TransformerBlock(i, c["hidden_size"], c["num_heads"], c["filter_size"], c["layer_norm_epsilon"],
                               c["num_hidden_layers"], ops, density, seed, act, init, c["dropout_rate"],
                               c["attention_dropout_rate"])
              for i in range(c["num_hidden_layers"])]
    units.append(LMHead(c["hidden_size"], c["vocab_size"], c["layer_norm_epsilon"], tied, ops, init["embedding"],
                        init["head"]))
    return GPT2(c, _mup(cfg, c, units), ops)


def _mup(cfg, c, units):
    """muP's model keys (Model Zoo 1.x spelling): ``embeddings_scale`` multiplies the embeddings,
    ``output_logits_scale`` the logits, ``scale_qk_dot_by_d`` divides q.k by the head size instead of
    its square root. They are set on the units (whose defaults change nothing)."""
    c["embeddings_scale"] = _number(cfg, "embeddings_scale", 1.0)
    given = cfg.get("output_logits_scale")
    c["output_logits_scale"] = None if given is None else _number(cfg, "output_logits_scale", 1.0)
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


#: Model Zoo's learning-rate adjustment groups (``optimizer.adjust_learning_rate``); decoder_kernel is
#: the three decoder groups together (its 1.x muP name).
LR_GROUPS = ("embedding", "decoder_kernel", "decoder_attention", "decoder_input_ffn", "decoder_output_ffn")


def _loss_scaling(cfg, c):
    """model.loss_scaling (num_tokens | batch_size) and model.loss_weight (Model Zoo's)."""
    scaling = cfg.get("loss_scaling", "num_tokens")
    if scaling not in ("num_tokens", "batch_size"):
        raise ValueError(f"model.loss_scaling: expected num_tokens or batch_size, got {show(scaling)}")
    weight = cfg.get("loss_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
        raise ValueError(f"model.loss_weight: expected a number > 0, got {show(weight)}")
    if scaling == "num_tokens" and weight != 1.0:
        raise ValueError(f"model.loss_weight: {show(weight)} has no effect with loss_scaling: num_tokens (Model Zoo "
                         "ignores it too); remove it, or use loss_scaling: batch_size")
    c["loss_scaling"], c["loss_weight"] = scaling, float(weight)


def _precision(cfg, c):
    """model.mixed_precision and model.fp16_type (float16 when not given, as Model Zoo before fp16_type)."""
    mixed = cfg.get("mixed_precision", False)
    if not isinstance(mixed, bool):
        raise TypeError(f"model.mixed_precision: expected true or false, got {show(mixed)}")
    kind = cfg.get("fp16_type")
    if kind is not None and kind not in FORMATS:
        raise ValueError(f"model.fp16_type: expected one of {', '.join(FORMATS)}, got {show(kind)}")
    c["mixed_precision"], c["fp16_type"] = mixed, (kind or "float16") if mixed else kind


def _rate(cfg, key, default):
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise ValueError(f"model.{key}: expected a number in [0, 1), got {show(v)}")
    return float(v)


def _decoder_initializers(cfg, c):
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
    c["output_logits_alpha"] = _number(cfg, "output_logits_alpha", 1.0) if cfg.get("output_logits_alpha") is not None \
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
    return c["hidden_size"] / _number(cfg, "mup_base_hidden_size", 1.0), c["filter_size"] / _number(
        cfg, "mup_base_filter_size", 1.0)


#: llama's keys beyond the decoder's common ones; each has one value wse-cluster builds (or a range).
_LLAMA_KEYS = (_GPT2_KEYS - {"sparsity", "sparsity_seed"}) | {
    "position_embedding_type", "rotary_dim", "rope_theta", "pos_scaling_factor", "pos_scaling_type",
    "pos_scaling_extra_args", "norm_type", "attention_module", "extra_attention_params",
    "use_projection_bias_in_attention", "use_ffn_bias_in_attention", "use_ffn_bias", "use_bias_in_output",
    "embedding_layer_norm", "attention_type"}
_LLAMA_FIXED = {"position_embedding_type": "rotary", "norm_type": "rmsnorm", "nonlinearity": "swiglu",
                "use_projection_bias_in_attention": False, "use_ffn_bias_in_attention": False, "use_ffn_bias": False,
                "use_bias_in_output": False, "embedding_layer_norm": False, "attention_type": "scaled_dot_product"}


def _number(cfg, key, default, low=0.0):
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low < v < float("inf"):
        raise ValueError(f"model.{key}: expected a number > {low:g}, got {show(v)}")
    return float(v)


def _build_llama(cfg, ops):
    """Model Zoo's llama: RMSNorm, rotary positions on adjacent pairs, SwiGLU, grouped-query attention
    (``attention_module: multiquery_attention`` with ``extra_attention_params.num_kv_groups``), no
    biases; the head tied or not (``share_embedding_weights``)."""
    from wse_core.nn.llama import LlamaBlock, RMSHead, Rotary

    _check_keys(cfg, _LLAMA_KEYS)
    c = {"name": "llama"}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "max_position_embeddings",
                "filter_size"):
        c[key] = _int(cfg, key)
    for key, value in _LLAMA_FIXED.items():
        given = cfg.get(key, value)
        if given != value or type(given) is not type(value):
            raise ValueError(f"model.{key}: llama is built with {show(value)}, got {show(given)}")
        c[key] = value
    if c["hidden_size"] % c["num_heads"]:
        raise ValueError(f"model.num_heads: {c['num_heads']} does not divide model.hidden_size {c['hidden_size']}")
    head_dim = c["hidden_size"] // c["num_heads"]
    c["layer_norm_epsilon"] = _number(cfg, "layer_norm_epsilon", 1e-5)
    tied = cfg.get("share_embedding_weights", True)
    if not isinstance(tied, bool):
        raise TypeError(f"model.share_embedding_weights: expected true or false, got {show(tied)}")
    c["share_embedding_weights"] = tied
    module = cfg.get("attention_module", "aiayn_attention")
    if module not in ("aiayn_attention", "multiquery_attention"):
        raise ValueError(f"model.attention_module: expected aiayn_attention or multiquery_attention, got {show(module)}")
    extra = cfg.get("extra_attention_params") or {}
    if not isinstance(extra, Mapping) or set(extra) - {"num_kv_groups"}:
        raise ValueError(f"model.extra_attention_params: expected {{num_kv_groups: N}}, got {show(extra)}")
    kv = _int(extra, "num_kv_groups") if module == "multiquery_attention" and "num_kv_groups" in extra \
        else c["num_heads"]
    c["attention_module"], c["extra_attention_params"] = module, {"num_kv_groups": kv}
    c["rotary_dim"] = _int(cfg, "rotary_dim") if "rotary_dim" in cfg else head_dim
    c["rope_theta"] = _number(cfg, "rope_theta", 10000.0)
    c["pos_scaling_factor"] = _number(cfg, "pos_scaling_factor", 1.0)
    c["pos_scaling_type"] = cfg.get("pos_scaling_type", "linear")
    extra_args = dict(cfg.get("pos_scaling_extra_args") or {})
    c["pos_scaling_extra_args"] = extra_args or None
    scaling = None
    if c["pos_scaling_type"] == "llama3":
        need = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in need if k not in extra_args]
        if missing or set(extra_args) - set(need):
            raise ValueError(f"model.pos_scaling_extra_args: llama3 scaling needs exactly {', '.join(need)}, "
                             f"got {show(extra_args)}")
        scaling = {"type": "llama3", "factor": c["pos_scaling_factor"],
                   **{k: float(extra_args[k]) for k in need}}
    elif c["pos_scaling_type"] != "linear":
        raise ValueError(f"model.pos_scaling_type: expected linear or llama3, got {show(c['pos_scaling_type'])}")
    elif c["pos_scaling_factor"] != 1.0:
        scaling = {"type": "linear", "factor": c["pos_scaling_factor"]}
    rotary = Rotary(head_dim, c["rotary_dim"], c["rope_theta"], c["max_position_embeddings"], scaling)
    _loss_scaling(cfg, c)
    _precision(cfg, c)
    init = _decoder_initializers(cfg, c)
    c["dropout_rate"] = _rate(cfg, "dropout_rate", 0.0)
    c["attention_dropout_rate"] = _rate(cfg, "attention_dropout_rate", c["dropout_rate"])
    c["embedding_dropout_rate"] = _rate(cfg, "embedding_dropout_rate", c["dropout_rate"])
    eps = c["layer_norm_epsilon"]
    units = [Embedding(c["vocab_size"], c["max_position_embeddings"], c["hidden_size"], ops, init["embedding"],
                       c["embedding_dropout_rate"], positions=False)]
    units += [LlamaBlock(i, c["hidden_size"], c["num_heads"], kv, c["filter_size"], eps, rotary, ops, init,
                         c["dropout_rate"], c["attention_dropout_rate"]) for i in range(c["num_hidden_layers"])]
    units.append(RMSHead(c["hidden_size"], c["vocab_size"], eps, tied, init["embedding"] if tied else init["head"], ops))
    return Llama(c, _mup(cfg, c, units), ops)


def _build_fc_mlp(cfg, ops):
    _check_keys(cfg, _MLP_KEYS)
    c = {"name": "fc_mlp", "input_size": _int(cfg, "input_size"), "num_classes": _int(cfg, "num_classes", 2)}
    hidden = cfg.get("hidden_sizes", [])
    if not isinstance(hidden, (list, tuple)):
        raise TypeError(f"model.hidden_sizes: expected a list of integers, got {show(hidden)}")
    for i, h in enumerate(hidden):
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h < 1:
            raise ValueError(f"model.hidden_sizes[{i}]: expected an integer >= 1, got {show(h)}")
    c["hidden_sizes"] = [int(h) for h in hidden]
    act = cfg.get("activation", "relu")
    if act not in ACTIVATIONS:
        raise ValueError(f"model.activation: unknown activation {show(act)} (known: {', '.join(ACTIVATIONS)})")
    c["activation"] = act
    density, seed = _sparsity(cfg, c)
    _precision(cfg, c)
    sizes = [c["input_size"], *c["hidden_sizes"], c["num_classes"]]
    units = [Dense(i, sizes[i], sizes[i + 1], act if i < len(sizes) - 2 else None, ops, density, seed)
             for i in range(len(sizes) - 1)]
    return Classifier(c, units, ops)
