"""Tokenizers for preprocessing: the built-in byte tokenizer, or a Hugging Face ``tokenizer.json``.

A tokenizer has ``name``, ``vocab_size``, ``eot_id`` (the end-of-text id that separates
documents), ``encode(text) -> list[int]``, ``encode_docs(texts) -> int32 array`` (every
document's ids, each followed by end-of-text: what preprocessing writes) and
``decode(ids) -> str``. Both are picklable so that preprocessing workers in other processes can
use them.

``write_hf_tokenizer`` writes a dataset's tokenizer beside exported weights (``wse checkpoint
convert --to hf``) as transformers' ``AutoTokenizer`` loads it, its ids those of the data.
"""
import itertools
import json
from pathlib import Path

import numpy as np

from data_tools.errors import DataError
from data_tools.lmdata import DATA_PARAMS, read_meta

EOT = "<|endoftext|>"  # the byte tokenizer's end-of-text, named as GPT-2 names its own


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 as end-of-text: vocabulary 257, nothing to download."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def encode_docs(self, texts):
        # 0xFF never occurs in UTF-8, so it can stand for end-of-text while the bytes are joined.
        joined = b"\xff".join(t.encode("utf-8", "replace") for t in texts) + (b"\xff" if texts else b"")
        raw = np.frombuffer(joined, np.uint8)
        out = raw.astype(np.int32)
        out[np.flatnonzero(raw == 0xFF)] = self.eot_id
        return out

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    # The data holds a text's literal "<|endoftext|>" as its bytes, so the exported tokenizer must
    # not turn it into the special id (transformers' split_special_tokens).
    splits_specials = True

    def hf_tokenizer(self):
        """This tokenizer as a ``tokenizers.Tokenizer`` with our ids: a BPE with no merges over GPT-2's
        byte-to-character alphabet (byte b is id b), and end-of-text 256."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        # GPT-2's map: printable bytes stand for themselves, the others for characters from U+0100 on.
        printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        others = [b for b in range(256) if b not in printable]
        chars = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
        tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
        return tok


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the optional ``tokenizers`` package."""

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"--tokenizer {path}: the optional 'tokenizers' package is not installed "
                            "(pip install tokenizers), or use --tokenizer byte") from None
        self.path = str(Path(path).resolve())
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as exc:  # the package raises a bare Exception for unreadable files
            raise DataError(f"--tokenizer {path}: not a readable tokenizer.json ({exc})") from None
        self.name = self.path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eot = next((self._tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "[SEP]", "<eos>")
                    if self._tok.token_to_id(t) is not None), None)
        if eot is None:
            raise DataError(f"--tokenizer {path}: no end-of-text token (<|endoftext|>, </s>, [SEP] or <eos>)")
        self.eot_id = eot

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_docs(self, texts):
        # One call for the whole batch: the Rust side encodes documents on its own threads, without
        # the GIL; ``_fast`` skips the character offsets we never use.
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        eot = [self.eot_id]
        total = sum(len(e.ids) for e in encodings) + len(encodings)
        return np.fromiter(itertools.chain.from_iterable(x for e in encodings for x in (e.ids, eot)),
                           np.int32, count=total)

    def decode(self, ids):
        return self._tok.decode(list(ids))

    splits_specials = False  # encode_docs, like transformers, reads added tokens in a text as themselves

    def hf_tokenizer(self):
        """A copy of the ``tokenizer.json``, without a post-processor that adds tokens (a template's
        ``<s>``): ``encode_docs`` added none, so the model never saw them."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(self.path)
        if tok.encode("a").ids != tok.encode("a", add_special_tokens=False).ids:
            tok.post_processor = None
        return tok


def get_tokenizer(spec):
    """``"byte"``, the path of a ``tokenizer.json``, or a directory holding one (a Hugging Face
    model directory, as Model Zoo's ``huggingface_tokenizer`` may name)."""
    if spec in (None, "byte"):
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"--tokenizer {spec}: no such file (use 'byte', a tokenizer.json or a directory holding one; "
                        "hub names need the network)")
    return HFTokenizer(path)


def data_tokenizer(data_dirs):
    """(tokenizer, eos id, pad id, first directory) of the dataset in ``data_dirs`` (a list: their
    files are one dataset), as its data_params.json name them; DataError saying why there is none."""
    made = {}  # directory -> (tokenizer, eos_id, pad_id) of its data_params.json
    for d in map(Path, data_dirs):
        if not d.is_dir():
            raise DataError(f"data_dir {d}: no such directory (moved since training?)")
        meta = read_meta(d)
        if "tokenizer" not in meta:
            raise DataError(f"{d / DATA_PARAMS}: names no tokenizer")
        made[d] = (meta["tokenizer"], meta.get("eos_id"), meta.get("pad_id"))
    first, (spec, eos, pad) = next(iter(made.items()))
    for d, which in made.items():
        if which != made[first]:
            raise DataError(f"data_dir {first} and {d}: tokenized differently ({spec}; {which[0]})")
    if spec != "byte" and not Path(spec).exists():
        raise DataError(f"{first / DATA_PARAMS}: tokenizer {spec} is not there (moved, or a hub name, "
                        "which needs the network)")
    tok = get_tokenizer(spec)
    eos = tok.eot_id if eos is None else eos
    return tok, eos, eos if pad is None else pad, first


def write_hf_tokenizer(data_dirs, out, *, vocab_size, max_length):
    """Write the tokenizer of the dataset in ``data_dirs`` (a list: their files are one dataset) to
    ``out`` as transformers' ``AutoTokenizer`` loads it: ``tokenizer.json``, ``tokenizer_config.json``
    and ``special_tokens_map.json``, end-of-text and pad the data's. Returns the ids ``config.json``
    takes; raises DataError saying why when there is no tokenizer to write."""
    try:
        import tokenizers  # noqa: F401  (checked here, once, rather than as each tokenizer is built)
    except ImportError:
        raise DataError("the optional 'tokenizers' package is not installed (pip install 'wse-cluster[hf]')") from None
    tok, eos, pad, first = data_tokenizer(data_dirs)
    spec = tok.name
    hf = tok.hf_tokenizer()
    if hf.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise DataError(f"{first}: its tokenizer has {hf.get_vocab_size(with_added_tokens=True)} ids, "
                        f"model.vocab_size only {vocab_size}")
    names = {}
    for key, i in (("eos_token", eos), ("pad_token", pad)):
        names[key] = hf.id_to_token(i)
        if names[key] is None:
            raise DataError(f"{first / DATA_PARAMS}: {key[:3]}_id {i} is no token of {spec}")
    # Each document of the data follows the previous one's end-of-text, and no document starts with
    # another token: end-of-text is what the model saw before a text (GPT-2's convention, too).
    special = {"bos_token": names["eos_token"], **names}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}  # decode gives the text back as it was
    if tok.splits_specials:
        config["split_special_tokens"] = True
    out = Path(out)
    hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": pad}
