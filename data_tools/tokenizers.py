"""Tokenizers for preprocessing: the built-in byte tokenizer, or a Hugging Face ``tokenizer.json``.

A tokenizer has ``name``, ``vocab_size``, ``eot_id`` (the end-of-text id that separates
documents), ``encode(text) -> list[int]``, ``encode_docs(texts) -> int32 array`` (every
document's ids, each followed by end-of-text: what preprocessing writes) and
``decode(ids) -> str``. Both are picklable so that preprocessing workers in other processes can
use them.
"""
import itertools
from pathlib import Path

import numpy as np

from data_tools.errors import DataError


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
