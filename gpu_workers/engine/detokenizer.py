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


class StopMatcher:
    """Aho-Corasick automaton over a request's stop strings, fed the output text as it
    grows: each character costs O(1) amortized however many and however long the stop
    strings are. Built once per request."""

    def __init__(self, stops: list[str]) -> None:
        # goto transitions in one dict keyed by node << 21 | code point (code points
        # need 21 bits): far smaller than a dict per node for long stop strings
        goto: dict[int, int] = {}
        edges = [0]  # per node, the goto key that leads to it
        levels: list[list[int]] = [[0]]  # nodes by depth
        # per node, the length of the longest stop string that ends there (0: none): the
        # longest is the one that starts earliest
        match = [0]
        for stop in stops:
            node = 0
            for d, ch in enumerate(stop, start=1):
                key = node << 21 | ord(ch)
                nxt = goto.get(key)
                if nxt is None:
                    nxt = goto[key] = len(edges)
                    edges.append(key)
                    match.append(0)
                    if d == len(levels):
                        levels.append([])
                    levels[d].append(nxt)
                node = nxt
            match[node] = len(stop)
        fail = [0] * len(edges)  # depth-1 nodes fail to the root
        for level in levels[2:]:  # by depth: a node's fail link is shallower, so done first
            for v in level:
                key = edges[v]
                c = key & 0x1FFFFF
                f = fail[key >> 21]
                while (target := goto.get(f << 21 | c)) is None and f:
                    f = fail[f]
                fail[v] = target or 0
                if not match[v]:
                    match[v] = match[fail[v]]
        self.goto, self.fail, self.match = goto, fail, match
        self.longest = max((len(s) for s in stops), default=0)
        self.node = 0

    def feed(self, text: str, offset: int) -> int:
        """Advance over `text`, which starts at index `offset` of the whole output text.
        Returns the start index of the earliest stop string that ends inside `text`, or -1."""
        goto, fail, match = self.goto, self.fail, self.match
        node = self.node
        best = -1
        for i, ch in enumerate(text, start=offset):
            c = ord(ch)
            while (nxt := goto.get(node << 21 | c)) is None and node:
                node = fail[node]
            node = nxt if nxt is not None else 0
            if match[node]:
                start = i - match[node] + 1
                if best < 0 or start < best:
                    best = start
        self.node = node
        return best
