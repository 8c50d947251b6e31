"""Hugging Face in and out: our gpt2/gpt3/llama against transformers' models on the same weights,
the checkpoint -> HF directory -> checkpoint round trip, and a run that starts from an HF model."""
import json

import numpy as np
import pytest
import yaml

from data_tools.checkpoint import Checkpoint, from_hf, save_checkpoint
from wse_core.nn import build_model
from wse_core.nn.hf import to_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GPT3 = {"name": "gpt3", "vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
        "filter_size": 48, "max_position_embeddings": 16}
LLAMA = {"name": "llama", "vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
         "filter_size": 48, "max_position_embeddings": 16, "rope_theta": 10000.0}
VARIANTS = {
    "gpt3-tied-gelu": GPT3,
    "gpt2-untied-gelu_new": dict(GPT3, name="gpt2", nonlinearity="gelu_new", share_embedding_weights=False),
    "llama-gqa-untied": dict(LLAMA, attention_module="multiquery_attention",
                             extra_attention_params={"num_kv_groups": 2}, share_embedding_weights=False),
    "llama-mha-tied-llama3": dict(LLAMA, pos_scaling_type="llama3", pos_scaling_factor=8.0, rope_theta=500.0,
                                  pos_scaling_extra_args={"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 4}),
}


def checkpoint_of(tmp_path, cfg, seed=3):
    """A checkpoint of ``cfg`` with random weights (norms and biases too, so none is trivially 1 or 0)."""
    model = build_model(cfg)
    rng = np.random.default_rng(seed)
    weights = {n: (w + rng.normal(0, 0.05, w.shape)).astype(np.float32)
               for n, w in model.init_params(seed).items()}
    path = save_checkpoint(tmp_path / "ckpt", 5, [(weights, {})],
                           params_yaml=yaml.safe_dump({"model": cfg}, sort_keys=False))
    return model, weights, path


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_equals_transformers_and_the_round_trip_is_exact(tmp_path, variant):
    cfg = VARIANTS[variant]
    model, weights, path = checkpoint_of(tmp_path, cfg)
    hf_dir = Checkpoint(path).convert("hf", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    assert type(hf).__name__ == config["architectures"][0]
    hf.eval()
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], (3, 12)).astype(np.int32)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    ours, _ = model.forward(weights, {"input_ids": ids})
    assert np.abs(ours - theirs).max() <= 1e-5 * max(1.0, np.abs(theirs).max())
    back, model_cfg = from_hf(hf_dir, tmp_path / "back")
    got, state = Checkpoint(back).load()
    assert set(got) == set(weights) and all(got[n].tobytes() == weights[n].tobytes() for n in weights)
    assert all(s == {} for s in state.values()) and Checkpoint(back).step == 0
    assert build_model(model_cfg).param_specs == model.param_specs


def test_a_run_starts_from_a_hugging_face_model(tmp_path, jobs):
    """Fine-tuning: a GPT2LMHeadModel saved by transformers becomes a checkpoint; `wse fit` starts
    from its weights (the optimizer fresh) and its first loss is the HF model's loss on that batch."""
    from data_tools.dataset import GlobalStream
    from data_tools.preprocess import preprocess_text

    data = tmp_path / "data"
    preprocess_text(["stdlib"], data, 16, samples_per_file=4000, progress=False)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=257, n_positions=16, n_embd=32, n_layer=2, n_head=2, activation_function="gelu",
        bos_token_id=0, eos_token_id=0))
    hf.save_pretrained(tmp_path / "pretrained")
    hf.eval()
    out = jobs.run("checkpoint", "from-hf", tmp_path / "pretrained", "--output", tmp_path / "model")
    assert out.returncode == 0, out.stderr
    model = yaml.safe_load(out.stdout.split("in PARAMS:\n", 1)[1])["model"]
    p = {"train_input": {"data_dir": str(data), "batch_size": 4, "shuffle": False},
         "model": model, "optimizer": {"learning_rate": 1e-4},
         "runconfig": {"max_steps": 2, "model_dir": str(tmp_path / "model")}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(p))
    ckpt = tmp_path / "model" / "checkpoint_0"
    run = jobs.run("fit", tmp_path / "p.yaml", "--checkpoint_path", ckpt)
    assert run.returncode == 0, run.stderr
    first = json.loads((tmp_path / "model" / "metrics.jsonl").read_text().splitlines()[0])
    stream = GlobalStream(data, shuffle=False, seed=0)
    ex = stream.read(0, 4)
    stream.close()
    ids, mask, labels = (torch.from_numpy(ex[:, i].astype(np.int64)) for i in range(3))
    with torch.no_grad():
        logits = hf(ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 257), labels.reshape(-1), reduction="none")
    want = float((loss * mask.reshape(-1)).sum() / mask.sum())
    assert first["loss"] == pytest.approx(want, rel=1e-5)


def test_bad_hugging_face_input_is_one_line(tmp_path):
    with pytest.raises(Exception, match="config.json: cannot read"):
        from_hf(tmp_path, tmp_path / "out")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception, match="model.safetensors: not a readable safetensors file"):
        from_hf(tmp_path, tmp_path / "out")
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match="model_type 'bert' is not built"):
        from_hf(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="model.rotary_dim: 4 is not the head size 8"):
        to_hf(build_model(dict(LLAMA, rotary_dim=4)).config, {})
