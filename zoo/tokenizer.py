"""Tokenizers: an HF ``tokenizer.json`` through ``tokenizers``, or zoo's byte tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from zoo.errors import ZooError


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS and EOS: used by the embedded default model."""

    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.bos_token_id] * add_special_tokens + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions
            raise ZooError(f"cannot read {path / 'tokenizer.json'}: {exc}") from None
        self.eos_token_id = None
        config = path / "tokenizer_config.json"
        if config.exists():
            eos = json.loads(config.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if eos is not None:
                self.eos_token_id = self.tokenizer.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens``: what the tokenizer's post-processor adds (a BOS), as transformers' tokenizer
        does by default; False for text that carries its own, a rendered chat template's."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class NoTokenizer:
    """For checkpoints without ``tokenizer.json``: requests must bring ``prompt_ids``."""

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ZooError("this checkpoint has no tokenizer.json: give prompt_ids instead of prompt text")

    def decode(self, ids: list[int]) -> str:
        return ""


def load_tokenizer(path: Path):
    if (path / "tokenizer.json").exists():
        return HFTokenizer(path)
    return NoTokenizer()
