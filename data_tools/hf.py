"""Hugging Face in and out: a checkpoint from a Hugging Face model directory, and a checkpoint as one.

``from_hf`` (``wse checkpoint from-hf``) reads ``config.json`` and ``*.safetensors`` of a
GPT2LMHeadModel or LlamaForCausalLM into a step-0, weights-only checkpoint; ``to_hf`` (``wse
checkpoint convert --to hf``) writes a checkpoint's weights as ``config.json`` and
``model.safetensors`` that transformers loads, beside the training data's tokenizer for
AutoTokenizer. The names and layouts of the tensors are wse_core.nn.hf's; the checkpoints are
data_tools.checkpoint's store.
"""
import json
import warnings
from pathlib import Path

import numpy as np

from data_tools.checkpoint import Checkpoint, save_checkpoint
from data_tools.errors import CheckpointError, DataError, DataWarning
from data_tools.tokenizers import write_hf_tokenizer


def read_hf(hf_dir):
    """(model, weights, config) of a Hugging Face directory (config.json, *.safetensors): our model of
    its architecture and its weights in our names; CheckpointError naming the file at fault."""
    from safetensors.numpy import load_file

    from wse_core.models import build_model
    from wse_core.nn.hf import from_hf as convert

    hf_dir = Path(hf_dir)
    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{hf_dir / 'config.json'}: cannot read ({exc})") from None
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir}: no *.safetensors file (a Hugging Face model directory has model.safetensors)")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: not a readable safetensors file ({exc})") from None
    try:
        model_cfg, weights = convert(config, tensors)
        model = build_model(model_cfg)
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{hf_dir}: {exc}") from None
    for name, spec in model.param_specs.items():
        if weights[name].shape != spec.shape:
            raise CheckpointError(f"{hf_dir}: tensor for {name} has shape {list(weights[name].shape)}, the config "
                                  f"says {list(spec.shape)}")
    return model, {n: weights[n] for n in model.param_names}, config


def from_hf(hf_dir, model_dir):
    """A checkpoint (step 0, weights only: the optimizer starts fresh) in ``model_dir`` from a Hugging
    Face directory (config.json, model.safetensors); returns (its path, the model section of the params
    a run on it needs)."""
    import yaml

    model, weights, _ = read_hf(hf_dir)
    path = save_checkpoint(model_dir, 0, [(weights, {})],
                           params_yaml=yaml.safe_dump({"model": model.config}, sort_keys=False))
    return path, model.config


def to_hf(path, output):
    """Write the checkpoint at ``path`` (what ``Checkpoint`` accepts) as a Hugging Face directory
    ``output``: config.json and model.safetensors that transformers' GPT2LMHeadModel /
    LlamaForCausalLM load, and the training data's tokenizer for AutoTokenizer, or a DataWarning
    saying why there is none; returns ``output`` as a Path. Sparse weights are written dense."""
    import yaml
    from safetensors.numpy import save_file

    from wse_core.models import build_model

    ckpt = Checkpoint(path)
    try:
        params = yaml.safe_load(ckpt.params_yaml)
        model = build_model(params["model"])
        if not model.is_lm:
            raise ValueError(f"model.name: {model.config['name']} has no Hugging Face counterpart here "
                             "(gpt2, gpt3, llama have)")
        config, tensors = model.to_hf(ckpt.dense(ckpt.load(model.param_names)[0]))
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{ckpt.dir}: --to hf: {exc}") from None
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    data = params.get("train_input") or {}
    dirs = data.get("data_dir") or [m["data_dir"] for m in data.get("mixture") or ()]
    try:
        if not dirs:
            raise DataError("the checkpoint's params name no train_input.data_dir")
        config.update(write_hf_tokenizer([dirs] if isinstance(dirs, str) else dirs, out,
                                         vocab_size=model.config["vocab_size"],
                                         max_length=model.config["max_position_embeddings"]))
    except DataError as exc:
        # Unset rather than transformers' defaults (GPT-2's 50256, LLaMA's 1 and 2), ids of other vocabularies.
        config.update(bos_token_id=None, eos_token_id=None)
        warnings.warn(f"{out}: no tokenizer written: {exc}", DataWarning, stacklevel=2)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
