"""Incremental detokenization: turn each step's new tokens into a text delta.

Decoding only a short window keeps the cost per token constant. A delta is held back
while the window ends inside a multi-byte character (decode yields U+FFFD there).
"""

from __future__ import annotations

from typing import Any

# Tokens of context kept in front of the unread ones, so tokenizers that strip or merge a
# leading space decode the boundary correctly.
_CONTEXT = 6


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        # The Rust tokenizer itself when transformers' decode would add nothing to it (no
        # clean-up of spaces): the Python wrapper costs ~10x the decode, twice per token.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text decoded so far

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (possibly '')."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
