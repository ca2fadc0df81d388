"""Constrained decoding: a request's `response_format`, `regex` or `choice` list, compiled
with llguidance into a matcher that tells, token by token, which tokens may come next.

The sampler masks a constrained row's logits with its matcher's token mask (computed for
all constrained rows of a step at once, in llguidance's threads); the engine advances the
matcher with each token it appends. A request keeps its matcher across preemption: its
generated tokens are kept too, so the state still describes them when it resumes.

llguidance rather than xgrammar (docs/architecture.md, "Structured output", has the
figures): it refuses the JSON-schema keywords it cannot enforce (`if`/`then`, `not`,
`uniqueItems`, ...) where xgrammar ignores them and lets outputs through that do not
validate; and it depends on nothing, where xgrammar brings triton (about 1 GB) to a CPU
install. Its masks cost more (tens of microseconds a row where xgrammar's take a few),
still a small part of a step.

Near the end of its max_tokens, a constrained output is steered to a completion
(`Grammars.steer`): a drawn token after which the grammar could no longer be completed in
the tokens left is replaced by the next token of a short completion, so an output ends
`stop` and parses whenever its grammar allows a completion that short.

One file, though long: compiling a constraint, caching the compiled grammars and steering
the sampler share llguidance's objects and the tokenizer's mapping.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from plurai.gpu_workers.engine.errors import ErrorCode, RequestError
from plurai.gpu_workers.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance

CACHE_SIZE = 256  # compiled grammars kept, by the hash of their spec
# The largest counted repetition a regex may hold, `{n}`, `{n,}` or `{n,m}`, its bound
# multiplied by those of the repetitions around it. llguidance builds a counted run's states
# as the output grows: `a{1000000}` compiles, then fails mid-output on its lexer's limit
# ("too many expressions constructed"), and long runs slow every step of the batch. `*` and
# `+` are unbounded and cost nothing: use them, or maxLength, for long free text.
MAX_REPEAT = 10_000
# JSON without optional whitespace: a weak or random model would otherwise fill max_tokens
# with spaces and newlines between the tokens that matter
JSON_OPTIONS = {"whitespace_flexible": False}
# Steering: a drawn token is checked once fewer than STEER_MARGIN tokens more than a
# completion's are left; before that a completion is looked for again after a quarter of
# the tokens to spare, STEER_EVERY at least (a token can lengthen it: one that opens an
# object with required fields). No completion longer than FINISH_MAX tokens is looked for.
STEER_MARGIN = 16
STEER_EVERY = 4
FINISH_MAX = 512
# the bytes that end the most: a string, an object, an array
_CLOSERS = b'"}]'


def spec(params: SamplingParams) -> tuple[str, str] | None:
    """The request's constraint as (kind, text): ("json", a schema), ("regex", a pattern);
    None when it has none. A choice list is a regex of its escaped alternatives."""
    rf = params.response_format
    if rf is not None and rf["type"] == "json_schema":
        return "json", json.dumps(rf["json_schema"]["schema"])  # its key order is the output's
    if rf is not None and rf["type"] == "json_object":
        return "json", '{"type":"object"}'
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "regex", "|".join(_escape(c) for c in params.choice)
    return None


_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# schema keywords whose values are data, not schemas: a "pattern" in them is no regex
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def check_limits(kind: str, text: str) -> str | None:
    """What makes a constraint too costly to serve (None: nothing): a regex, or a JSON
    schema's `pattern` or `patternProperties` regex, with a counted repetition over
    MAX_REPEAT. Checked before compiling, so such a request is refused at add, not failed
    mid-output."""
    if kind == "regex":
        return _regex_limits(text)
    return _schema_limits(json.loads(text), "")


def _schema_limits(node: Any, where: str) -> str | None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            problem = _schema_limits(item, f"{where}/{i}")
            if problem is not None:
                return problem
        return None
    if not isinstance(node, dict):
        return None
    for key, value in node.items():
        at = f"{where}/{key}"
        if key in _DATA_KEYWORDS:
            continue
        patterns = []
        if key == "pattern" and isinstance(value, str):
            patterns = [value]
        elif key == "patternProperties" and isinstance(value, dict):
            patterns = list(value)
        for pattern in patterns:
            problem = _regex_limits(pattern)
            if problem is not None:
                return f"{problem} (in the schema's {at})"
        problem = _schema_limits(value, at)
        if problem is not None:
            return problem
    return None


def _regex_limits(pattern: str) -> str | None:
    """A counted repetition of `pattern` (llguidance's regex syntax, Rust's) whose bound,
    times the bounds of the groups it is in, is over MAX_REPEAT: described; else None."""
    # per open group: [the largest run inside it, the run of its last atom]
    frames = [[1, 1]]
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i += 2
            if pattern[i - 1 : i] in ("x", "u", "U", "p", "P") and pattern[i : i + 1] == "{":
                close = pattern.find("}", i)
                i = n if close < 0 else close + 1  # \x{..}, \u{..}, \p{..}: one atom
            frames[-1][1] = 1
            continue
        if ch == "[":
            i = _class_end(pattern, i)
            frames[-1][1] = 1
            continue
        if ch == "(":
            frames.append([1, 1])
        elif ch == ")" and len(frames) > 1:
            inner = frames.pop()[0]
            frames[-1][1] = inner
            frames[-1][0] = max(frames[-1][0], inner)
        elif ch == "{" and (m := _COUNT.match(pattern, i)):
            digits = m.group(2) or m.group(1)
            bound = int(digits) if len(digits) <= 9 else 10**9  # int() refuses 4,300+ digits
            run = frames[-1][1] * bound
            if run > MAX_REPEAT:
                shown = m.group(0) if len(m.group(0)) <= 24 else m.group(0)[:20] + "...}"
                return (
                    f"the repetition {shown} at character {i} asks for runs of up to {run} "
                    f"(with the counts of the groups around it), over the limit of "
                    f"{MAX_REPEAT}; use * or + for an unbounded run, or smaller counts"
                )
            frames[-1][1] = run
            frames[-1][0] = max(frames[-1][0], run)
            i = m.end()
            continue
        elif ch not in "|*+?":
            frames[-1][1] = 1
        i += 1
    return None


def _class_end(pattern: str, start: int) -> int:
    """The index past the character class opening at `start` (nested classes included; a
    `]` first in a class is a literal)."""
    depth, i, n = 0, start, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            depth += 1
            i += 1
            if pattern[i : i + 1] == "^":
                i += 1
            if pattern[i : i + 1] == "]":
                i += 1
            continue
        if ch == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _escape(text: str) -> str:
    """`text` as a literal of llguidance's regex syntax (Rust's): every ASCII character but
    letters and digits escaped (allowed for all punctuation, needed for the meta ones),
    control characters and spaces by their code."""
    out = []
    for ch in text:
        if ch.isascii() and ch.isalnum():
            out.append(ch)
        elif ch.isascii() and (ch.isspace() or not ch.isprintable()):
            out.append(f"\\x{ord(ch):02x}")
        elif ch.isascii():
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


@dataclass
class Steer:
    """A constrained sequence's steering state: the length of a completion of its output
    found after `searched` output tokens (FINISH_MAX + 1: none), and that completion while
    the output is still there."""

    searched: int = -(1 << 30)
    length: int = 1 << 30
    path: list[int] | None = None


class Grammars:
    """The engine's compiler and mask filler, built at the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._hf = tokenizer
        self._eos = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._cache: OrderedDict[bytes, Any] = OrderedDict()
        # per token: its first byte's rank for completions (lower first) and its length
        self._first: np.ndarray | None = None
        self._rank: np.ndarray | None = None
        self._length: np.ndarray | None = None
        self._lock = threading.Lock()  # matcher() may be called from an intake thread
        self.compiled = 0  # grammars compiled (cache misses), for tests and stats

    def _setup(self) -> None:
        import llguidance
        import llguidance.hf

        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        except Exception as e:  # a slow (Python) tokenizer, or one llguidance cannot read
            raise RequestError(
                ErrorCode.INVALID_PARAMS,
                f"this model's tokenizer does not support constrained decoding "
                f"(response_format, regex, choice): {type(e).__name__}: {e}"[:500],
            ) from None
        self._executor = llguidance.LLExecutor()

    def matcher(self, params: SamplingParams) -> Any | None:
        """A fresh matcher for the request's constraint (None: it has none). Raises
        RequestError(INVALID_PARAMS) with the reason for a schema or regex that does not
        compile, uses a keyword that cannot be enforced, is over a resource limit
        (check_limits), or admits no first token."""
        s = spec(params)
        if s is None:
            return None
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                self._setup()
            key = hashlib.sha256(f"{s[0]}\0{s[1]}".encode()).digest()
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
                return proto.deep_copy()
            kind, text = s
            what = "JSON schema" if kind == "json" else "choice" if params.choice else "regex"
            problem = check_limits(kind, text)
            if problem is not None:
                raise _refuse(what, problem)
            if kind == "json":
                try:
                    grammar = llguidance.LLMatcher.grammar_from_json_schema(
                        text, defaults=JSON_OPTIONS
                    )
                except ValueError as e:
                    raise _refuse(what, str(e)) from None
            else:
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            # the default resource limits bound what one grammar may cost to build and to step
            limits = llguidance.LLParserLimits(verbose_errors=False)
            m = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits)
            if m.is_error():
                raise _refuse(what, m.get_error())
            first = self._bits([m])  # a matcher can fail only here, computing its mask
            if m.is_error() or not first.any():
                raise _refuse(
                    what, "no token of this model's vocabulary can start an output it allows"
                )
            self.compiled += 1
            self._cache[key] = m
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return m.deep_copy()

    def allowed(self, matchers: list[Any], drafts: list[list[int]] | None = None) -> np.ndarray:
        """The tokens each matcher allows next, as a bool array [rows, vocab]; with
        `drafts` (a list of proposed tokens per matcher, speculator.py) a matcher has a row
        for each proposal too, its mask after the proposals before it. Raises GrammarError
        for a matcher in an error state (it hit a resource limit)."""
        bits = self._bits(matchers, drafts)
        for m in matchers:
            if m.is_error():
                raise GrammarError(m.get_error())
        # bit t of row i is token t (little-endian words, low bit first)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return allowed[:, : self.vocab_size].view(np.bool_)

    def steer(self, seq: Any, token: int, left: int) -> int:
        """The token `seq` appends: `token`, drawn from its grammar's mask, unless the grammar
        could not be completed within the `left - 1` tokens left after it while it could
        after another; then the next token of a completion. Near the end the completion is
        found anew each token, so what is appended depends on the output so far alone."""
        st: Steer = seq.steer
        if self.slack(seq, left) > 0 or st.length > FINISH_MAX:
            return token  # room to spare, or no completion short enough
        pos = seq.num_output_tokens
        path = st.path if st.searched == pos else None
        if path is None:
            path = self._search(seq, left)
            if path is None:
                return token
        if not path or token == path[0]:
            return token
        m = seq.matcher
        if not m.consume_token(token):
            return token  # not in the mask: the engine refuses it (a bug, not the output's)
        try:
            after = self.finish(m, left - 1)
        finally:
            m.rollback(1)
        if after is not None:
            return token
        return path[0]

    def slack(self, seq: Any, left: int) -> int:
        """How many more tokens than a completion of `seq`'s output needs `left` holds,
        less STEER_MARGIN: while that is positive any token may be drawn. The completion is
        looked for again once a quarter of that has been drawn, and every STEER_EVERY
        tokens near the end or while none is short enough (a token can lengthen it: one
        that opens an object with required fields)."""
        st: Steer = seq.steer
        slack = left - st.length - STEER_MARGIN
        due = max(STEER_EVERY, slack // 4)
        if seq.num_output_tokens - st.searched >= due:
            self._search(seq, left)
            slack = left - st.length - STEER_MARGIN
        return slack

    def _search(self, seq: Any, left: int) -> list[int] | None:
        st: Steer = seq.steer
        path = self.finish(seq.matcher, min(left, FINISH_MAX))
        st.searched, st.path = seq.num_output_tokens, path
        st.length = len(path) if path is not None else FINISH_MAX + 1
        return path

    def finish(self, m: Any, limit: int) -> list[int] | None:
        """Tokens that complete the output from `m`'s state, the end of sequence token last
        where the grammar needs one to stop ([] when it has stopped); None when none of at
        most `limit` tokens was found. `m` is left as it was.

        Greedy, not a search: the tokens llguidance says are forced, else the shortest
        allowed token of the best first byte: one that closes (a string, an object, an
        array), then one that was not allowed a token ago (the next part of a structure
        rather than more of a run), then separators, punctuation, digits and letters. So it
        may be longer than the shortest completion, which only makes steering start early.
        """
        if self._rank is None:
            self._tables()
        assert self._first is not None and self._rank is not None and self._length is not None
        out: list[int] = []
        consumed = 0
        before = None  # the first bytes allowed a token ago
        try:
            while True:
                if m.is_stopped():
                    return out
                if m.is_accepting():
                    return out + self._eos[:1] if len(out) < limit and self._eos else None
                if len(out) >= limit:
                    return None
                forced = m.compute_ff_tokens()
                if forced:
                    step, before = forced, None
                else:
                    ids = np.flatnonzero(self.allowed([m])[0])
                    if not len(ids):
                        return None
                    ranks, firsts = self._rank[ids], self._first[ids]
                    now = np.zeros(256, dtype=np.bool_)
                    now[firsts] = True
                    if before is not None:  # a first byte allowed a token ago ranks lower
                        ranks = ranks + np.where(before[firsts] & (ranks >= 256), 1 << 12, 0)
                    pick = ids[np.lexsort((self._length[ids], ranks))[0]]
                    step, before = [int(pick)], now
                for t in step:
                    if not m.consume_token(t):
                        return None
                    consumed += 1
                out += step
        except GrammarError:
            return None
        finally:
            if consumed:
                m.rollback(consumed)

    def _tables(self) -> None:
        """Each token's first byte, that byte's rank for `finish`, and the token's length."""
        assert self._tokenizer is not None
        order = np.zeros(256, dtype=np.int64)
        for b in range(256):
            ch = chr(b)
            group = 1 if ch in ",:" else 2 if not ch.isalnum() else 3 if ch.isdigit() else 4
            order[b] = group << 8 | b
        for i, b in enumerate(_CLOSERS):
            order[b] = i  # before everything else
        n = self.vocab_size
        first = np.zeros(n, dtype=np.int64)
        rank = np.full(n, 1 << 20, dtype=np.int64)  # special and empty tokens: never picked
        length = np.zeros(n, dtype=np.int64)
        for t in range(n):
            if self._tokenizer.is_special_token(t):
                continue
            data = self._tokenizer.decode_bytes([t])
            if data:
                first[t], rank[t], length[t] = data[0], order[data[0]], len(data)
        self._first, self._rank, self._length = first, rank, length

    def _bits(self, matchers: list[Any], drafts: list[list[int]] | None = None) -> np.ndarray:
        """Each matcher's next-token bitmask (and one after each of its proposals), filled
        by llguidance's threads at once."""
        assert self._executor is not None
        if not drafts or not any(drafts):
            bits = np.zeros((len(matchers), self.words), dtype=np.int32)
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)],
                bits.ctypes.data,
                self.words * 4,
                len(bits),
            )
            return bits
        entries, row = [], 0
        for m, d in zip(matchers, drafts, strict=True):
            entries.append((m, row, d))
            row += 1 + len(d)
        bits = np.zeros((row, self.words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr_with_draft_token(
            entries, bits.ctypes.data, self.words * 4, row
        )
        return bits


class GrammarError(RuntimeError):
    """A matcher failed mid-output (a parser resource limit): that request fails alone."""


def _refuse(what: str, reason: str) -> RequestError:
    reason = " ".join(line.strip() for line in reason.splitlines() if line.strip())
    return RequestError(
        ErrorCode.INVALID_PARAMS, f"invalid {what}: {reason or 'it does not compile'}"[:500]
    )
