"""The model families by the params' ``model.name``, and ``build_model``, which builds one.

``build_model({"name": "gpt2", "vocab_size": 257, ...})`` returns a ``Model``; unknown keys and
bad values raise a ``ConfigError`` (a ValueError; a ``ConfigTypeError`` for a value of the wrong type)
naming the key (``model.num_heads: ...``). It sits above both ``wse_core.nn`` (the built-in families)
and ``wse_core.compiler`` (the family ``torch``, a user's PyTorch model, whose units are ``nn``'s), so
neither sub-package imports the other's way back (tests/test_imports.py).
"""
import sys
from collections.abc import Mapping

from wse_core.checks import did_you_mean, show
from wse_core.errors import ConfigError, ConfigTypeError
from wse_core.nn import ops as fused_ops
from wse_core.nn.gpt import build_gpt2
from wse_core.nn.llama import build_llama
from wse_core.nn.mlp import build_fc_mlp


def build_torch(cfg, ops=None):
    """A compiled PyTorch model (``wse_core.compiler``; PyTorch is imported only for this family, whose
    units run torch's own kernels, not ``ops``)."""
    from wse_core.compiler.model import TorchModel, load_program
    from wse_core.nn.config import TorchConfig

    c = TorchConfig.from_params(cfg)
    return TorchModel(c.to_dict(), load_program(c.program))


#: ``model.name`` -> the builder of its family (Model Zoo's gpt3 is the GPT-2 architecture in
#: Cerebras-GPT's shapes).
FAMILIES = {"gpt2": build_gpt2, "gpt3": build_gpt2, "llama": build_llama, "fc_mlp": build_fc_mlp,
            "torch": build_torch}


def build_model(cfg, ops=fused_ops):
    """Build a ``Model`` from the ``model`` section of the params (a plain dict)."""
    if not isinstance(cfg, Mapping):
        raise ConfigTypeError(f"model: expected a mapping, got {type(cfg).__name__}")
    name = cfg.get("name")
    sys.audit("wse.build_model", name)  # how often a process builds its model (test_cluster.py counts)
    if isinstance(name, str) and name in FAMILIES:
        return FAMILIES[name](cfg, ops)
    raise ConfigError(f"model.name: unknown model {show(name)} ({did_you_mean(name, tuple(FAMILIES))})")
