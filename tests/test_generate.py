"""Generation (issue 26, first step): a KV cache through the models' own layers, greedy decoding equal
to transformers' generate token for token, seeded sampling independent of the batch, `wse generate`."""
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import yaml

from data_tools.checkpoint import save_checkpoint
from wse_core.models import build_model
from wse_core.nn.generate import Sampling, generate
from wse_core.nn.kv import KVCache

GPT2 = {"name": "gpt2", "vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
        "filter_size": 48, "max_position_embeddings": 24}
LLAMA = {"name": "llama", "vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
         "filter_size": 48, "max_position_embeddings": 24, "attention_module": "multiquery_attention",
         "extra_attention_params": {"num_kv_groups": 2}, "share_embedding_weights": False}
FAMILIES = {"gpt2": GPT2, "llama": LLAMA}
PROMPTS = [[5, 7, 9], [1, 2, 3, 4, 5, 6, 7], [42]]


def weights_of(cfg, seed=3):
    """Random weights far from the initialisation (norms and biases too), so greedy paths are not flat."""
    model = build_model(cfg)
    rng = np.random.default_rng(seed)
    return model, {n: (w + rng.normal(0, 0.3, w.shape)).astype(np.float32) for n, w in model.init_params(seed).items()}


def made(model, weights, prompts, n, sampling=Sampling(), stop_ids=()):
    out = [[] for _ in prompts]
    for k, token in generate(model, weights, prompts, n, sampling, stop_ids):
        out[k].append(token)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kv_cache_gives_the_full_forwards_logits_for_sequences_of_different_lengths(family):
    """Two sequences prefilled at lengths 6 and 3, then decoded side by side: each step's logits are
    those of the full forward pass at that position, to float32 rounding."""
    model, w = weights_of(FAMILIES[family])
    ids = np.random.default_rng(0).integers(0, 61, (2, 12)).astype(np.int32)
    full, _ = model.forward(w, {"input_ids": ids})
    kv = KVCache(24)
    a, b = kv.add(), kv.add()
    got = [model.infer(w, ids[:1, :6], kv, [a])[0], model.infer(w, ids[1:, :3], kv, [b])[0]]
    want = [full[0, 5], full[1, 2]]
    for step in range(5):
        rows = model.infer(w, np.array([[ids[0, 6 + step]], [ids[1, 3 + step]]], np.int32), kv, [a, b])
        got += list(rows)
        want += [full[0, 6 + step], full[1, 3 + step]]
    for g, f in zip(got, want):
        assert np.abs(g - f).max() <= 1e-5 * max(1.0, np.abs(f).max())
    assert kv.lengths == {a: 11, b: 8}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers_generate_token_for_token(tmp_path, family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from data_tools.hf import to_hf
    from pyapi.generate import Generator

    cfg = FAMILIES[family]
    model, w = weights_of(cfg)
    path = save_checkpoint(tmp_path / "ckpt", 1, [(w, {})], params_yaml=yaml.safe_dump({"model": cfg}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer to write: the params name no data
        hf_dir = to_hf(path, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ours = Generator.load(path).generate(PROMPTS, 16)  # 7 + 16 tokens: within the 24 positions
    from_hf_dir = Generator.load(hf_dir).generate(PROMPTS, 16)
    for k, p in enumerate(PROMPTS):
        theirs = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert ours[k].tokens == theirs == from_hf_dir[k].tokens, k
        assert ours[k].finish_reason == "length"
    assert len(set(map(tuple, (c.tokens for c in ours)))) == 3  # the prompts lead apart


def test_sampling_is_seeded_and_independent_of_the_other_sequences():
    model, w = weights_of(LLAMA)
    s = Sampling(temperature=0.9, top_k=12, top_p=0.9, seed=7)
    alone = made(model, w, [PROMPTS[1]], 12, s)[0]
    together = made(model, w, PROMPTS, 12, s)
    assert together[1] == alone == made(model, w, [PROMPTS[1]], 12, s)[0]
    assert made(model, w, [PROMPTS[1]], 12, Sampling(temperature=0.9, top_k=12, top_p=0.9, seed=8))[0] != alone
    greedy = made(model, w, [PROMPTS[1]], 12)[0]
    assert alone != greedy and made(model, w, [PROMPTS[1]], 12, Sampling(temperature=1.0, top_k=1))[0] == greedy


def test_what_generation_refuses_is_one_line():
    model, w = weights_of(GPT2)
    with pytest.raises(ValueError, match=r"^prompt 1: 24 tokens; the model holds 24 positions "
                                         r"\(model.max_position_embeddings\), so at most 23 leave room for one more$"):
        made(model, w, [[1], list(range(24))], 3)
    with pytest.raises(ValueError, match=r"^prompt 0: empty"):
        made(model, w, [[]], 3)
    for bad in (-1, 61):  # numpy would wrap -1 to the last row; 61 is past the table
        with pytest.raises(ValueError, match=rf"^prompt 1: token id {bad} outside the model's vocabulary \[0, 61\)"):
            made(model, w, [[1], [2, bad]], 3)
    with pytest.raises(ValueError, match=r"^top_p: expected a number in \(0, 1\]"):
        Sampling(top_p=0)
    # a sequence stops at a stop id (not given back) and at the model's positions
    first = made(model, w, [[5, 7, 9]], 30)[0]
    assert len(first) == 24 - 3
    assert made(model, w, [[5, 7, 9]], 30, stop_ids=[first[4]])[0] == first[:first.index(first[4])]


def byte_model_run(tmp_path):
    """A model_dir (tmp_path / "run") of a 64-position GPT-2 whose params name byte-tokenized data; its config
    and weights."""
    from data_tools.preprocess import preprocess_text

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    preprocess_text([tmp_path / "text"], tmp_path / "data", 16, progress=False)
    cfg = dict(GPT2, vocab_size=257, max_position_embeddings=64)
    model, w = weights_of(cfg)
    params = {"train_input": {"data_dir": str(tmp_path / "data")}, "model": cfg}
    save_checkpoint(tmp_path / "run", 3, [(w, {})], params_yaml=yaml.safe_dump(params))
    return cfg, w


def test_wse_generate_prints_the_text_of_a_trained_model_with_its_datas_tokenizer(tmp_path):
    """A model_dir whose params name byte-tokenized data: the prompt and its continuation stream to
    stdout; several prompts with --json give each its completion; a text prompt without a tokenizer
    is one line."""
    from pyapi.generate import Generator

    cfg, w = byte_model_run(tmp_path)
    wse = [sys.executable, "-m", "pyapi.cli"]
    one = subprocess.run([*wse, "generate", str(tmp_path / "run"), "--prompt", "def f(", "--max_new_tokens", "12"],
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    want = Generator.load(tmp_path / "run").generate("def f(", 12)[0]
    assert one.stdout == "def f(" + want.text + "\n" and len(want.tokens) == 12
    assert want.prompt_ids == [256, *b"def f("]  # after end-of-text, as every document of the data
    many = subprocess.run([*wse, "generate", str(tmp_path / "run"), "--prompt", "a", "--prompt", "return",
                           "--max_new_tokens", "5", "--temperature", "0.7", "--seed", "1", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert many.returncode == 0, many.stderr
    got = json.loads(many.stdout)
    assert [g["prompt"] for g in got] == ["a", "return"] and all(len(g["tokens"]) == 5 for g in got)
    save_checkpoint(tmp_path / "bare", 3, [(w, {})], params_yaml=yaml.safe_dump({"model": cfg}))
    bare = subprocess.run([*wse, "generate", str(tmp_path / "bare"), "--prompt", "x"], capture_output=True,
                          text=True, timeout=120)
    assert bare.returncode != 0 and bare.stderr.strip().splitlines() == [
        f"wse generate: error: a text prompt needs a tokenizer ({tmp_path / 'bare' / 'checkpoint_3'}: no tokenizer: "
        "its params name no train_input.data_dir); give token ids instead"]


def test_more_new_tokens_than_the_model_holds_are_refused_and_a_prompt_that_cuts_them_short_is_said(tmp_path):
    """As `wse serve` refuses a max_tokens above its limit, --max_new_tokens beyond the model's positions
    less one is refused in one line (it stopped at 63 without a word); asked for more than a prompt leaves
    room for, the completion ends at the positions and says so on stderr; not asked, a prompt gets what fits
    (64 at most), silently."""
    from pyapi.generate import Generator

    byte_model_run(tmp_path)
    gen = Generator.load(tmp_path / "run")
    with pytest.raises(ValueError, match=r"^max_new_tokens: 64; the model holds 64 positions "
                                         r"\(model.max_position_embeddings\), so at most 63 tokens follow a prompt$"):
        gen.generate("def f(", 64)
    wse = [sys.executable, "-m", "pyapi.cli", "generate", str(tmp_path / "run"), "--prompt", "def f("]
    refused = subprocess.run([*wse, "--max_new_tokens", "1000"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and refused.stderr.splitlines() == [
        "wse generate: error: max_new_tokens: 1000; the model holds 64 positions (model.max_position_embeddings), "
        "so at most 63 tokens follow a prompt"]
    [want] = gen.generate("def f(", 63)
    assert want.finish_reason == "length" and len(want.prompt_ids) + len(want.tokens) == 64  # 7 + 57
    cut = subprocess.run([*wse, "--max_new_tokens", "63"], capture_output=True, text=True, timeout=120)
    assert cut.returncode == 0 and cut.stdout == "def f(" + want.text + "\n"
    assert cut.stderr.splitlines() == ["wse generate: stopped at the model's 64 positions (model.max_position_"
                                       "embeddings): 7 of the prompt, 57 of the 63 new tokens asked"]
    quiet = subprocess.run(wse, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and quiet.stdout == cut.stdout and quiet.stderr == ""


def test_a_compiled_pytorch_language_model_generates_as_transformers_does(tmp_path):
    """A GPT2LMHeadModel captured by the compiler (its step: cross-entropy of its logits), with weights far
    from the initialisation: Generator's greedy tokens equal transformers' generate on the same weights,
    for prompts of different lengths side by side."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from pyapi.generate import Generator
    from wse_core.compiler import capture, partition
    from wse_core.compiler.model import save_program

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=61, n_positions=16, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    hf = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 61, (4, 16))

    def lm_loss(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    graph = capture(hf, (ids, ids.roll(-1, 1)), lm_loss)
    save_program(graph, partition(graph), tmp_path / "gpt2.pt2")
    model = build_model({"name": "torch", "program": str(tmp_path / "gpt2.pt2")})
    rng = np.random.default_rng(0)
    w = {n: (v + rng.normal(0, 0.3, v.shape)).astype(np.float32) for n, v in model.init_params(0).items()}
    ours = Generator(model, w).generate(PROMPTS[:2], 8)
    hf.eval().load_state_dict({k: torch.from_numpy(w[k]) if k in w else v for k, v in hf.state_dict().items()})
    for c, p in zip(ours, PROMPTS):
        theirs = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert c.tokens == theirs, p
    with pytest.raises(ValueError, match=r"^--num_csx: a compiled PyTorch model generates in this process only"):
        Generator(model, w).engine(num_csx=1)


def test_a_compiled_model_that_is_not_causal_is_refused_in_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    from pyapi.generate import Generator
    from wse_core.compiler import capture, partition
    from wse_core.compiler.model import save_program

    class Bidirectional(torch.nn.Module):  # every position sees every other: no next-token model
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(61, 16)
            self.mix = torch.nn.Linear(12 * 16, 12 * 16)
            self.head = torch.nn.Linear(16, 61)

        def forward(self, ids):
            x = self.embed(ids)
            return self.head(self.mix(x.flatten(1)).view(x.shape))

    def lm_loss(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    ids = torch.randint(0, 61, (4, 12))
    graph = capture(Bidirectional(), (ids, ids.roll(-1, 1)), lm_loss)
    save_program(graph, partition(graph), tmp_path / "bi.pt2")
    model = build_model({"name": "torch", "program": str(tmp_path / "bi.pt2")})
    with pytest.raises(ValueError, match=r"^m: the compiled model is not causal: the logits at a position change "
                                         r"with the tokens after it, so it cannot generate$"):
        Generator(model, model.init_params(0), source="m")
