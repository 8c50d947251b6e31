"""The model base class: an ordered list of streaming units, the loss on the last one's output,
parameters, their initialisation and memory, the units' passes in the run's precision; and
``LanguageModel``, the decoders' batch layout and loss. Families: ``gpt``, ``llama``, ``mlp``;
``wse_core.models.build_model`` builds one from the params' ``model`` section.

Batches are dicts of arrays whose first axis is the sample; each family (``GPT2``, ``Llama``:
``LanguageModel``; ``Classifier``) defines its own layout, loss and activation estimate.
"""
import zlib

import numpy as np

from wse_core.errors import ConfigError, DataError
from wse_core.nn import ops as fused_ops
from wse_core.nn.init import draw
from wse_core.nn.gemm import products_in
from wse_core.nn.precision import Precision
from wse_core.nn.sample_tree import sums_in


#: Model Zoo's learning-rate adjustment groups (``optimizer.adjust_learning_rate``); decoder_kernel is
#: the three decoder groups together (its 1.x muP name).
LR_GROUPS = ("embedding", "decoder_kernel", "decoder_attention", "decoder_input_ffn", "decoder_output_ffn")


class Model:
    """An ordered list of streaming units plus the loss on the last unit's output.

    A model family (``LanguageModel``: ``GPT2``, ``Llama``; ``Classifier``) adds its batch layout,
    its loss, its accuracy, its memory estimate and its Hugging Face names; this base class holds
    what every family shares: parameters, initialisation, the units' passes in the run's precision.
    """

    family = "model"
    is_lm = False
    #: Why the family's sums over a micro-batch's samples depend on the micro-batch (its bits change with
    #: micro_batch_size, so with num_csx under ``auto``), or None: they do not (``nn.sample_tree``; docs/design.md
    #: section 5, (a)).
    batch_dependent = "a family of its own"

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

    # -- memory: every count of parameters and their bytes is made here ---------------------------

    def num_params(self):
        return sum(int(np.prod(s.shape)) for s in self.param_specs.values())

    def _bytes(self, names, itemsize):
        return sum(int(np.prod(self.param_specs[n].shape)) for n in names) * itemsize

    def unit_bytes(self, itemsize=4):
        """Bytes of each unit's own parameters (a shared parameter counts for its first unit only): what
        MemoryX stores and updates."""
        seen, out = set(), []
        for names in self.unit_params:
            own = [n for n in names if n not in seen]
            seen.update(own)
            out.append(self._bytes(own, itemsize))
        return out

    def stream_bytes(self, itemsize=4):
        """Bytes streamed for each unit: every parameter it uses (a tied one with each unit that uses it)."""
        return [self._bytes(names, itemsize) for names in self.unit_params]

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
                raise ConfigError(f"optimizer.adjust_learning_rate.{group}: unknown group "
                                  f"(known: {', '.join(LR_GROUPS)})")
        factors = {}
        for name, spec in self.param_specs.items():
            g = spec.lr_group
            scales = {adjust[k] for k in adjust if g is not None and (k == g or (k == "decoder_kernel"
                                                                                 and g.startswith("decoder_")))}
            if len(scales) > 1:
                raise ConfigError(f"optimizer.adjust_learning_rate: {name} is in groups with different scales "
                                  f"{sorted(scales)}")
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

    def check_dataset(self, fmt, example_shape, vocab_size, where, columns=None):
        """Raise a ValueError (one line, naming ``where``) if a dataset of format ``fmt`` ("lm",
        "arrays" or "tensors"), examples of ``example_shape`` and ``vocab_size`` (or None) cannot feed
        this model; ``columns``: the dataset's [(name, dtype, example shape)]."""
        if fmt != "arrays":
            raise ConfigError(f"{where} is {'LM' if fmt == 'lm' else 'tensor'} data; {self.config['name']} needs an "
                              "array dataset")

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

    def step_values(self, y, batch):
        """What else a micro-batch's step hands its script, from its forward's ``y`` (before
        ``loss``), as ``combine_values`` takes them: None (a compiled model's hands values)."""
        return None

    def combine_values(self, parts):
        """The step's values from its micro-batches' ``step_values``, in the global batch's order."""
        return []

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
        """Unit u's forward; its output leaves in the run's precision (docs/design/numerics.md "Mixed precision")."""
        with products_in(self.precision.products):
            y, saved = self.units[u].forward(x, params, drop)
        return self.precision.round_(y), saved

    def unit_backward(self, u, dy, saved, params):
        """Unit u's backward; its input gradient and weight gradients in the run's precision."""
        # A loss scale too big overflows: it is detected later.
        with np.errstate(over="ignore", invalid="ignore"), products_in(self.precision.products), \
                sums_in(self.precision):
            dx, grads = self.units[u].backward(dy, saved, params)
        for g in grads.values():
            self.precision.round_(g)
        return (dx if dx is None else self.precision.round_(dx)), grads

    def forward_backward(self, params, batch, drop=None, loss_scale=1.0):
        """(loss_sum, n_tokens, unit_grads, [step_values]) for one micro-batch; unit_grads[i] holds
        unit i's gradients (of the loss times ``loss_scale``)."""
        y, saved = self.forward(params, batch, drop)
        values = self.step_values(y, batch)
        loss_sum, n_tokens, dy = self.loss(y, batch, loss_scale)
        unit_grads = [None] * len(self.units)
        for i in reversed(range(len(self.units))):
            dy, unit_grads[i] = self.unit_backward(i, dy, saved[i], params)
            saved[i] = None  # free activations as soon as the unit is done
        return loss_sum, n_tokens, unit_grads, [values]

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
    batch_dependent = None  # every weight's gradient and the loss are trees over samples

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
            raise DataError(f"batch['input_ids']: sequence length {ids.shape[1]} exceeds "
                            f"model.max_position_embeddings {cfg['max_position_embeddings']}")
        if ids.size and (ids.min() < 0 or ids.max() >= cfg["vocab_size"]):
            raise DataError(f"batch['input_ids']: ids must be in [0, {cfg['vocab_size']}), "
                            f"got {ids.min()}..{ids.max()}")
        return ids.shape[0]

    def check_dataset(self, fmt, example_shape, vocab_size, where, columns=None):
        c = self.config
        if fmt != "lm":
            raise ConfigError(f"{where} is {'an array' if fmt == 'arrays' else 'a tensor'} dataset; {c['name']} needs "
                              "LM data")
        if example_shape[-1] > c["max_position_embeddings"]:
            raise ConfigError(f"model.max_position_embeddings: {c['max_position_embeddings']} is shorter than the "
                              f"max_seq_length {example_shape[-1]} of {where}")
        if vocab_size is not None and vocab_size > c["vocab_size"]:
            raise ConfigError(f"model.vocab_size: {c['vocab_size']} is smaller than the vocabulary {vocab_size} of "
                              f"{where} (its data_params.json)")

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
                raise DataError(f"{name} {bad} outside the model's vocabulary [0, {v}) (model.vocab_size): the data "
                                "was tokenized with another vocabulary")
        return batch

    def first_input(self, batch, dtype):
        return np.ascontiguousarray(batch["input_ids"])

    def infer(self, params, ids, kv, active):
        """A generation step: the logits [b, vocab] of the last of the new tokens ``ids`` [b, t] of the
        sequences ``active`` (ids in the KV cache ``kv``, ``wse_core.nn.kv``), whose caches grow by t.
        ``params``: the weights the CS-2s compute with (``compute_weights``). Each unit's ``infer`` is
        its training forward but for attention over the cache; outputs in the run's precision."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        return self.infer_units(params, ids, kv, active, 0, len(self.units), ids.shape[1])[:, -1]

    def infer_units(self, params, x, kv, active, first, end, t):
        """Units ``first`` .. ``end`` - 1 of a generation step of ``t`` new positions: ``x`` is unit
        ``first``'s input (token ids for the first unit), the last unit's output is returned whole.
        A CS-2 of the cluster runs its own units this way (docs/design/inference.md "Inference
        on the cluster"); ``infer`` runs them all."""
        kv.begin(active, t)
        last = len(self.units) - 1
        for u in range(first, end):
            if u == last:  # only the last position's logits are needed
                x = np.ascontiguousarray(x[:, -1:])
            with products_in(self.precision.products):
                x = self.precision.round_(self.units[u].infer(x, params, kv))
        kv.end()
        return x

    def correct(self, y, batch):
        hit = np.argmax(y, axis=-1) == batch["labels"]
        return int(np.count_nonzero(hit & (batch["loss_mask"] != 0)))

    def _cross_entropy(self, y, batch):
        b, t, v = y.shape
        mask = np.ascontiguousarray(batch["loss_mask"]).reshape(-1)
        loss_sum, dy = self.ops.cross_entropy(y.reshape(b * t, v), np.ascontiguousarray(batch["labels"]).reshape(-1),
                                              mask, sample_rows=t)
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
