"""Hugging Face in and out: our gpt2/gpt3/llama against transformers' models on the same weights,
the checkpoint -> HF directory -> checkpoint round trip, and a run that starts from an HF model."""
import contextlib
import json
import logging
import warnings

import numpy as np
import pytest
import yaml

from data_tools.checkpoint import Checkpoint, save_checkpoint
from data_tools.errors import DataWarning
from data_tools.hf import from_hf, to_hf
from wse_core.models import build_model
from wse_core.nn import hf as nn_hf

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


def checkpoint_of(tmp_path, cfg, seed=3, data_dir=None):
    """A checkpoint of ``cfg`` with random weights (norms and biases too, so none is trivially 1 or 0),
    trained on ``data_dir`` as far as its params say."""
    model = build_model(cfg)
    rng = np.random.default_rng(seed)
    weights = {n: (w + rng.normal(0, 0.05, w.shape)).astype(np.float32)
               for n, w in model.init_params(seed).items()}
    params = {"model": cfg} if data_dir is None else {"train_input": {"data_dir": str(data_dir)}, "model": cfg}
    path = save_checkpoint(tmp_path / "ckpt", 5, [(weights, {})], params_yaml=yaml.safe_dump(params, sort_keys=False))
    return model, weights, path


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_equals_transformers_and_the_round_trip_is_exact(tmp_path, variant):
    cfg = VARIANTS[variant]
    model, weights, path = checkpoint_of(tmp_path, cfg)
    with pytest.warns(DataWarning, match="no tokenizer written: the checkpoint's params name no train_input"):
        hf_dir = to_hf(path, tmp_path / "hf")
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
        nn_hf.to_hf(build_model(dict(LLAMA, rotary_dim=4)).config, {})


# --- the export's tokenizer -----------------------------------------------------------------------

# Characters of 1 to 4 UTF-8 bytes, and a special token's name as plain text.
DOC = "Grüße aus Köln, 日本語 🎉 and a literal <|endoftext|> in the text.\n"
SMALL = {"gpt2": dict(GPT3, name="gpt2", vocab_size=257, max_position_embeddings=128),
         "llama": dict(LLAMA, vocab_size=257, max_position_embeddings=128)}


@pytest.fixture
def offline(monkeypatch):
    """No network: the Hub's offline mode (read once, when huggingface_hub was imported, so set there too)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@contextlib.contextmanager
def no_warnings():
    """Fail on any Python warning, or warning transformers logs, inside."""
    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert [str(w.message) for w in caught] + [r.getMessage() for r in logged] == []


def corpus(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(DOC)
    (tmp_path / "text" / "b.txt").write_text("def f(x):\n    return x + 1\n" * 3)
    return tmp_path / "text"


def stream_of(data_dir):
    """The token stream a dataset was cut from: its examples' inputs, one after the other."""
    from data_tools.dataset import Dataset

    ds = Dataset(data_dir)
    ex = ds.read(0, ds.n_examples)
    ds.close()
    return ex[:, 0].ravel().tolist()


def load(hf_dir):
    hf_dir = str(hf_dir)
    return transformers.AutoTokenizer.from_pretrained(hf_dir), transformers.AutoModelForCausalLM.from_pretrained(hf_dir)


@pytest.mark.parametrize("family", SMALL)
def test_the_export_loads_with_the_byte_tokenizer_of_its_data_and_generates(tmp_path, family, offline):
    """`convert --to hf` of a model trained on byte-tokenized data: AutoTokenizer gives the data's ids
    (non-ASCII UTF-8, a literal special's name as bytes), end-of-text 256 is eos, pad and bos in the
    tokenizer and config.json alike, nothing warns, and generate runs."""
    from data_tools.preprocess import preprocess_text

    preprocess_text([corpus(tmp_path)], tmp_path / "data", 16, progress=False)
    _, _, path = checkpoint_of(tmp_path, SMALL[family], data_dir=tmp_path / "data")
    with no_warnings():
        hf_dir = to_hf(path, tmp_path / "hf")
        tok, model = load(hf_dir)
        ids = tok(DOC)["input_ids"]
        assert ids + [256] == stream_of(tmp_path / "data")[:len(ids) + 1]
        assert len(ids) == len(DOC.encode()) and tok.decode(ids) == DOC
        assert tok.eos_token_id == tok.pad_token_id == tok.bos_token_id == 256
        c = model.config
        assert c.eos_token_id == c.pad_token_id == c.bos_token_id == 256 and c.vocab_size == len(tok) == 257
        prompt = tok("Grüße", return_tensors="pt")
        out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, len("Grüße".encode()) + 5) and tok.decode(out[0]).startswith("Grüße")


def test_the_export_copies_a_tokenizer_json_with_the_datas_special_tokens(tmp_path, offline):
    """A dataset tokenized by a tokenizer.json: the export holds that tokenizer, end-of-text the data's,
    and gives the data's ids (its template's <s>, which preprocessing never added, dropped)."""
    tokenizers = pytest.importorskip("tokenizers")
    from data_tools.preprocess import preprocess_text

    text = corpus(tmp_path)
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train([str(f) for f in text.iterdir()], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A",
                                                                  special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    bpe.save(str(tmp_path / "tok.json"))
    meta = preprocess_text([text], tmp_path / "data", 16, tokenizer=str(tmp_path / "tok.json"), progress=False)
    cfg = dict(SMALL["gpt2"], vocab_size=bpe.get_vocab_size())
    _, _, path = checkpoint_of(tmp_path, cfg, data_dir=tmp_path / "data")
    with no_warnings():
        tok, model = load(to_hf(path, tmp_path / "hf"))
        ids = tok(DOC)["input_ids"]
        assert ids + [meta["eot_id"]] == stream_of(tmp_path / "data")[:len(ids) + 1]
        assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == model.config.eos_token_id == meta["eot_id"]
        assert tok.pad_token_id == model.config.pad_token_id == meta["pad_id"]
        model.generate(**tok("def f", return_tensors="pt"), max_new_tokens=3, do_sample=False)


def test_an_export_whose_data_moved_has_its_weights_and_says_in_one_line_why_no_tokenizer(tmp_path, jobs, offline):
    """The dataset is gone: weights and config.json are written, one line says why there is no tokenizer,
    and config.json claims no special ids (not transformers' defaults from another vocabulary)."""
    _, _, path = checkpoint_of(tmp_path, SMALL["gpt2"], data_dir=tmp_path / "gone")
    out = jobs.run("checkpoint", "convert", path, "--to", "hf", "--output", tmp_path / "hf")
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [f"wse checkpoint: warning: {tmp_path / 'hf'}: no tokenizer written: "
                                       f"data_dir {tmp_path / 'gone'}: no such directory (moved since training?)"]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    with no_warnings():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.config.eos_token_id is None and model.config.bos_token_id is None


def test_an_export_without_the_tokenizers_package_says_so(tmp_path, monkeypatch):
    import sys

    from data_tools.preprocess import preprocess_text

    preprocess_text([corpus(tmp_path)], tmp_path / "data", 16, progress=False)
    _, _, path = checkpoint_of(tmp_path, SMALL["llama"], data_dir=tmp_path / "data")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what a default install without the hf extra has
    with pytest.warns(DataWarning, match=r"no tokenizer written: the optional 'tokenizers' package is not installed "
                                         r"\(pip install 'wse-cluster\[hf\]'\)"):
        to_hf(path, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not (tmp_path / "hf" / "tokenizer.json").exists()
