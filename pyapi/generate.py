"""Text from a trained model: ``wse generate`` and ``pyapi.generate.Generator`` (docs/user-guide.md,
"Generating text").

``Generator.load(SOURCE)`` reads a model from a model_dir (its latest checkpoint), a checkpoint
directory, or a Hugging Face model directory (config.json and *.safetensors, through
``data_tools.hf``), with its tokenizer: the training data's (byte, or the tokenizer.json its
data_params.json names) for ours, the directory's tokenizer.json for a Hugging Face one. A text
prompt is encoded after the end-of-text token, which is what the model saw before every document
(the data's convention, and the exported tokenizer's ``bos_token``); generation stops at
end-of-text. ``generate`` runs ``wse_core.nn.generate`` (a KV cache; the model's own layers) and
returns one ``Completion`` per prompt, calling ``on_token(k, token, text)`` as each token comes.
"""
import json
from dataclasses import dataclass, field
from pathlib import Path

from data_tools.errors import DataError
from wse_core.errors import ConfigError
# Imported where used: the kernels (wse_core.models, wse_core.nn.generate), after configure_process();
# torch (wse_core.compiler.generate), for compiled models alone; h5py and yaml (data_tools.checkpoint,
# tokenizers, hf), for loading a checkpoint; mpi_launch.inference, looked up when a cluster engine starts
# (tests replace its ClusterEngine).

#: Tokens a prompt gets when none are asked (fewer when the model holds fewer positions).
DEFAULT_NEW_TOKENS = 64


@dataclass
class Completion:
    """One prompt's continuation. ``finish_reason``: "stop" (the model ended the text) or "length"
    (``max_new_tokens``, or the model's positions, reached)."""

    prompt: str | None
    prompt_ids: list
    tokens: list = field(default_factory=list)
    text: str | None = None
    finish_reason: str = "length"


def finish_reason(prompt_tokens, made, max_new_tokens, capacity):
    """Why a sequence of ``prompt_tokens`` ended after ``made`` tokens: "stop" (at an end-of-text, before
    ``max_new_tokens`` and the model's ``capacity`` positions) or "length"."""
    return "stop" if made < max_new_tokens and prompt_tokens + made < capacity else "length"


class TextPieces:
    """The text of a sequence's tokens, given piece by piece as they come: ``add(token)`` returns what
    the token adds to the decoded text ("" while a character's bytes are incomplete: the decoder
    would show U+FFFD for them); ``rest()`` what is still held back once the sequence has ended.
    With ``stops`` (strings), the text ends before the first of them to appear: ``stopped`` is then
    set, and what could still become one is held back until it cannot (OpenAI's ``stop``)."""

    def __init__(self, tokenizer, stops=()):
        self.tokenizer, self.tokens, self.shown, self.stops = tokenizer, [], "", tuple(stops)
        self.stopped = False

    def add(self, token):
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if self.stops:
            found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            if found:
                self.stopped, text = True, text[:min(found)]
            else:  # the longest end of the text that a stop could still start with
                held = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
                text = text[:len(text) - held]
        if (text.endswith("\ufffd") and not self.stopped) or not text.startswith(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def rest(self):
        text = self.text()
        return text[len(self.shown):] if text.startswith(self.shown) else ""

    def text(self):
        """The sequence's text: up to its stop, or all of it."""
        return self.shown if self.stopped else self.tokenizer.decode(self.tokens)


class Generator:
    """A model ready to generate: its weights, its tokenizer (or None: prompts of token ids only),
    the token a text follows (``bos_id``) and those that end one (``stop_ids``)."""

    def __init__(self, model, weights, tokenizer=None, *, bos_id=None, stop_ids=(), source="", source_format=None,
                 why_no_tokenizer="", home=None):
        if getattr(model, "family", None) == "torch":  # a compiled PyTorch model (wse_core.compiler.generate)
            from wse_core.compiler.generate import Recompute

            try:
                self._recompute = Recompute(model, weights)  # refuses, in one line, a model that cannot generate
            except ValueError as exc:
                raise ConfigError(f"{source}: {exc}") from None
            self.capacity, self.vocab_size = self._recompute.capacity, self._recompute.vocab_size
        elif not getattr(model, "is_lm", False) or not hasattr(model, "infer"):
            raise ConfigError(f"{source}: model {model.config['name']}: generating is built for the language models "
                              "(gpt2, gpt3, llama, and compiled PyTorch models of token ids)")
        else:
            self.capacity, self.vocab_size = model.config["max_position_embeddings"], model.config["vocab_size"]
        self.model, self.weights, self.tokenizer = model, weights, tokenizer
        self.bos_id, self.stop_ids, self.source, self.source_format = bos_id, tuple(stop_ids), source, source_format
        self.why_no_tokenizer = why_no_tokenizer
        self.home = Path(home if home is not None else source)  # the directory named to ``load``

    @classmethod
    def load(cls, source, checkpoint_path=None):
        """From a model_dir, a checkpoint, or a Hugging Face directory; ValueError naming what is wrong."""
        import yaml

        from data_tools.checkpoint import Checkpoint
        from data_tools.tokenizers import data_tokenizer, get_tokenizer

        path = Path(source)
        if checkpoint_path is None and (path / "config.json").is_file():  # a Hugging Face directory
            from data_tools.hf import read_hf

            model, weights, config = read_hf(path)
            tok, why = None, f"{path}: no tokenizer.json"
            if (path / "tokenizer.json").is_file():
                tok = get_tokenizer(str(path))
            # generation_config.json may name more ends (an instruct model's end-of-turn), as transformers reads it
            stops = []
            for f in ("config.json", "generation_config.json"):
                try:
                    eos = json.loads((path / f).read_text()).get("eos_token_id")
                except (OSError, ValueError):
                    continue
                stops += [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None and e not in stops]
            return cls(model, weights, tok, bos_id=config.get("bos_token_id"), source=str(path), source_format="hf",
                       stop_ids=stops, why_no_tokenizer=why, home=path)
        from wse_core.models import build_model

        ckpt = Checkpoint(checkpoint_path if checkpoint_path is not None else path)
        params = yaml.safe_load(ckpt.params_yaml) or {}
        if "model" not in params:
            raise DataError(f"{ckpt.dir}: its params name no model")
        model = build_model(params["model"])
        weights = ckpt.dense(ckpt.load(model.param_names)[0])
        data = params.get("train_input") or {}
        dirs = data.get("data_dir") or [m["data_dir"] for m in data.get("mixture") or ()]
        try:
            if not dirs:
                raise DataError("its params name no train_input.data_dir")
            tok, eos, _, _ = data_tokenizer([dirs] if isinstance(dirs, str) else dirs)
        except DataError as exc:
            return cls(model, weights, source=str(ckpt.dir), source_format="checkpoint",
                       why_no_tokenizer=f"{ckpt.dir}: no tokenizer: {exc}", home=path)
        return cls(model, weights, tok, bos_id=eos, stop_ids=(eos,), source=str(ckpt.dir), source_format="checkpoint",
                   home=path)

    def engine(self, num_csx=None, **options):
        """Where the forward passes run: this process (``num_csx`` None: ``wse_core.nn.generate.Engine``),
        or an inference job on ``num_csx`` emulated CS-2s (``mpi_launch.inference.ClusterEngine``, with
        its ``options``: max_streams, placement, peer_timeout, num_wgt_servers, swarmx_fanout, stream,
        log_dir, each None for its default; log_dir's, where a failed job's logs go, is
        ``inference_logs`` in the directory the model was loaded from), the same tokens either way.
        Close it when done (``with``)."""
        from wse_core.nn.generate import Engine

        if getattr(self.model, "family", None) == "torch":
            if num_csx is not None:
                raise ConfigError("--num_csx: a compiled PyTorch model generates in this process only (its graph "
                                  "has no KV cache to place on the wafers)")
            return Engine(self.model, runner=self._recompute.fresh())
        if num_csx is None:
            return Engine(self.model, self.weights)
        if self.source_format is None:
            raise ConfigError(f"{self.source or 'this model'}: a model given as weights in memory runs in this process "
                              "only; load it from a checkpoint or a Hugging Face directory to run it on CS-2s")
        from mpi_launch.inference import LOGS, ClusterEngine

        options = {"log_dir": self.home / LOGS, **{k: v for k, v in options.items() if v is not None}}
        return ClusterEngine(self.model, self.source, self.source_format, num_csx=num_csx, **options)

    def encode(self, prompt):
        """A prompt's ids: a text through the tokenizer, after ``bos_id``; a list of ids as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"a text prompt needs a tokenizer ({self.why_no_tokenizer}); give token ids instead")
            return ([] if self.bos_id is None else [self.bos_id]) + list(self.tokenizer.encode(prompt))
        return [int(i) for i in prompt]

    def new_tokens(self, asked=None):
        """The tokens a prompt is given: ``asked``, at most the model's positions less one (more is refused
        in one line, as `wse serve` refuses a max_tokens above its limit: no prompt could leave room for
        them); None: DEFAULT_NEW_TOKENS, or fewer when the model holds fewer (and, as ever, no more than a
        prompt leaves room for: the default asks for no particular number)."""
        most = self.capacity - 1
        if asked is None:
            return min(DEFAULT_NEW_TOKENS, most)
        if asked > most:
            raise ConfigError(f"max_new_tokens: {asked}; the model holds {self.capacity} positions "
                              f"(model.max_position_embeddings), so at most {most} tokens follow a prompt")
        return asked

    def generate(self, prompts, max_new_tokens=None, *, temperature=0.0, top_k=0, top_p=1.0, seed=0, on_token=None,
                 engine=None):
        """One Completion per prompt (a text or a list of token ids); ``on_token(k, token, text)`` is
        called as each token of prompt k is made (``text``: what it adds to the decoded text, held
        back while a character's bytes are incomplete). ``engine``: an idle one of ``engine()`` (an
        inference job on CS-2s); default: this process.

        ``max_new_tokens``: see ``new_tokens``. A prompt too long to leave room for them all ends at the
        model's positions (``finish_reason`` "length", as OpenAI's API says it)."""
        from wse_core.nn.generate import Sampling, generate

        max_new_tokens = self.new_tokens(max_new_tokens)
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        out = [Completion(p if isinstance(p, str) else None, self.encode(p)) for p in prompts]
        pieces = [TextPieces(self.tokenizer) if self.tokenizer is not None else None for _ in out]
        engine = engine if engine is not None else self.engine()  # this process's: nothing to close
        for k, tok in generate(self.model, self.weights, [c.prompt_ids for c in out], max_new_tokens, sampling,
                               self.stop_ids, engine=engine):
            out[k].tokens.append(tok)
            if on_token is not None:
                on_token(k, tok, "" if pieces[k] is None else pieces[k].add(tok))
        for c in out:
            c.finish_reason = finish_reason(len(c.prompt_ids), len(c.tokens), max_new_tokens, self.capacity)
            if self.tokenizer is not None:
                c.text = self.tokenizer.decode(c.tokens)
        return out
