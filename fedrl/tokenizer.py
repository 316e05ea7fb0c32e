"""A character tokenizer for the tiny built-in model: one token per task symbol."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<sep>", "<eos>")
# Every symbol the built-in tasks write: reversal uses digits as its alphabet (M <= 10),
# addition needs the operator and the equals sign.
ALPHABET = "0123456789+="


class CharTokenizer:
    """Encodes task strings symbol by symbol; ids 0-3 are <pad>, <bos>, <sep>, <eos>."""

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated symbols: {alphabet!r}")
        self.alphabet = alphabet
        self.vocab = list(SPECIALS) + list(alphabet)
        self._ids = {s: i for i, s in enumerate(self.vocab)}
        self.pad_token_id, self.bos_token_id, self.sep_token_id, self.eos_token_id = 0, 1, 2, 3

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as err:
            raise ValueError(
                f"symbol {err.args[0]!r} is not in the tokenizer's alphabet {self.alphabet!r}"
            ) from None

    def decode(self, ids) -> str:
        """Symbols up to the first <eos>; other special tokens are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_token_id:
                break
            if i >= len(SPECIALS):
                out.append(self.vocab[i])
        return "".join(out)

    def encode_prompt(self, text: str) -> list[int]:
        """<bos> prompt <sep>: the model answers after <sep>."""
        return [self.bos_token_id, *self.encode(text), self.sep_token_id]

    def save_pretrained(self, directory: str | Path) -> None:
        Path(directory, "fedrl_tokenizer.json").write_text(json.dumps({"alphabet": self.alphabet}))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> CharTokenizer:
        return cls(json.loads(Path(directory, "fedrl_tokenizer.json").read_text())["alphabet"])
