"""fc_mlp (``Classifier``): Dense layers on float features, cross-entropy over classes."""
import numpy as np

from wse_core.nn.config import MLPConfig
from wse_core.nn.layers import Dense
from wse_core.nn.model import Model


class Classifier(Model):
    """fc_mlp: batches of float ``features`` ``[B, input_size]`` and int32 ``labels`` ``[B]`` (every sample counts)."""

    family = "fc_mlp"
    batch_dependent = None  # a sample is one row, its products its own (layers.Dense)

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
        loss_sum, dy = self.ops.cross_entropy(y, np.ascontiguousarray(batch["labels"]), np.ones(y.shape[0], np.int32),
                                              sample_rows=1)
        return loss_sum, y.shape[0], dy


def build_fc_mlp(cfg, ops):
    """fc_mlp: Dense layers of ``hidden_sizes`` with ``activation`` between them, then ``num_classes``."""
    c = MLPConfig.from_params(cfg)
    sizes = [c.input_size, *c.hidden_sizes, c.num_classes]
    units = [Dense(i, sizes[i], sizes[i + 1], c.activation if i < len(sizes) - 2 else None, ops, 1.0 - c.sparsity,
                   c.sparsity_seed) for i in range(len(sizes) - 1)]
    return Classifier(c.to_dict(), units, ops)
