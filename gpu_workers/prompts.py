"""A request's prompt as token ids: exactly one of prompt text, token ids or chat messages,
validated, with the same rules and error codes on every backend.

Special-token text written in a prompt or a message content is plain text; only the chat
template's own special tokens (and the tokenizer's BOS) are special, unless the request
opts in with `special_tokens`.
"""

from __future__ import annotations

import bisect
import re
from typing import Any

from plurai.broker_config.errors import ErrorCode, valid_messages
from plurai.gpu_workers.backend import RequestError

# stands for message i's content when the chat template is rendered to find where the
# contents land (private-use characters: no template filter changes them)
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


def check_options(priority: Any, cache_salt: Any, special_tokens: Any) -> None:
    """The request options every backend takes beside the prompt and sampling fields."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError(
            ErrorCode.INVALID_PARAMS, f"priority must be an integer, got {priority!r}"
        )
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise RequestError(
            ErrorCode.INVALID_PARAMS,
            f"cache_salt must be a non-empty string, got {cache_salt!r}",
        )
    if not isinstance(special_tokens, bool):
        raise RequestError(
            ErrorCode.INVALID_PARAMS,
            f"special_tokens must be a boolean, got {special_tokens!r}",
        )


class Prompts:
    """Tokenizes requests for one model's tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        added = self.tokenizer.added_tokens_decoder
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.specials = sorted({added[i].content for i in self.special_ids})
        # a content may also start or end a special token together with the template's text
        self._special_prefixes = {s[:k] for s in self.specials for k in range(1, len(s))}
        self._special_suffixes = {s[k:] for s in self.specials for k in range(1, len(s))}
        self._special_len = max(map(len, self.specials), default=0)

    def tokenize(
        self,
        prompt: str | None = None,
        token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
        special_tokens: bool = False,
    ) -> list[int]:
        """Token ids for exactly one of prompt / token_ids / messages, validated (and short
        enough to leave room for one generated token).

        Special-token text written in a prompt or a message content is tokenized as plain
        text; only the chat template's own special tokens (and the tokenizer's BOS) are
        special. `special_tokens=True` lets prompt and content text name special tokens.
        """
        given = [x is not None for x in (prompt, token_ids, messages)]
        if sum(given) != 1:
            raise RequestError(
                ErrorCode.INVALID_PROMPT, "give exactly one of prompt, token_ids or messages"
            )
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise RequestError(ErrorCode.INVALID_PROMPT, "prompt must be a non-empty string")
            ids = self.tokenizer(prompt, split_special_tokens=not special_tokens).input_ids
        elif messages is not None:
            if not valid_messages(messages):
                raise RequestError(
                    ErrorCode.INVALID_PROMPT,
                    "messages must be a non-empty list of {role: str, content: str} objects",
                )
            ids = self._chat_ids(messages, special_tokens)
        else:
            if not isinstance(token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in token_ids
            ):
                raise RequestError(ErrorCode.INVALID_PROMPT, "token_ids must be a list of integers")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    ErrorCode.TOKEN_OUT_OF_VOCAB,
                    f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                )
            ids = list(token_ids)
        if not ids:
            raise RequestError(ErrorCode.INVALID_PROMPT, "the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt has {len(ids)} tokens; this model serves at most "
                f"{self.max_model_len} tokens including at least one generated token, "
                f"so shorten the prompt to {self.max_model_len - 1} tokens or fewer",
            )
        return ids

    def _render(self, messages: list[dict]) -> str:
        from jinja2 import TemplateError  # what transformers renders chat templates with

        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:  # e.g. roles that do not alternate as the template wants
            raise RequestError(
                ErrorCode.INVALID_PROMPT, f"the chat template refused the messages: {e}"
            ) from e

    def _touches_special(self, text: str) -> bool:
        """Whether text holds a special token's text, or could form one with its neighbours."""
        if any(s in text for s in self.specials):
            return True
        n = min(len(text), self._special_len - 1)
        return any(
            text[-k:] in self._special_prefixes or text[:k] in self._special_suffixes
            for k in range(1, n + 1)
        )

    def _chat_ids(self, messages: list[dict], special_tokens: bool) -> list[int]:
        """The rendered chat, tokenized so that only the template's own special tokens are
        special: the text of each message content is plain text.

        Tokenizing splits the text at special tokens and tokenizes the pieces between them
        on their own. So the rendered text is tokenized as usual, the special tokens that
        lie in a content are found by their offsets, and only the pieces (between two of
        the template's specials) that hold one are tokenized again with special tokens
        split. Contents without special-token text take the usual path unchanged.
        """
        if not special_tokens and any(self._touches_special(m["role"]) for m in messages):
            # roles steer the template's branches, so they cannot be replaced to find them
            raise RequestError(ErrorCode.INVALID_PROMPT, "a message role holds special-token text")
        text = self._render(messages)
        tok = self.tokenizer
        if special_tokens or not any(self._touches_special(m["content"]) for m in messages):
            return tok(text, add_special_tokens=False).input_ids
        spans = self._content_spans(messages, text)
        if spans is None:
            raise RequestError(
                ErrorCode.INVALID_PROMPT,
                "a message content holds special-token text (such as "
                f"{self.specials[0]!r}) and this model's chat template rewrites contents, so "
                "the engine cannot keep that text plain: remove it or send token_ids",
            )
        starts = [a for a, _ in spans]
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc.input_ids, enc.offset_mapping
        out: list[int] = []
        first, begin, dirty = 0, 0, False  # the current piece: first token, first char
        for i, t in enumerate(ids):
            if t not in self.special_ids:
                continue
            a, b = offsets[i]
            j = bisect.bisect_left(starts, b) - 1
            if j >= 0 and spans[j][1] > a:  # in (or across the edge of) a content
                dirty = True
                continue
            out += self._plain(text[begin:a]) if dirty else ids[first:i]
            out.append(t)
            first, begin, dirty = i + 1, b, False
        out += self._plain(text[begin:]) if dirty else ids[first:]
        return out

    def _plain(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids

    def _content_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]] | None:
        """Where the message contents lie in the rendered `text`, in order: the template is
        rendered again with placeholders for the contents, which are then put back (as
        they are, or stripped as templates that `trim` them do). None when neither gives
        `text` back: the template does more with the contents."""
        marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        try:
            pieces = _PLACEHOLDER.split(self._render(marked))
        except RequestError:  # the template checks contents: it does more than place them
            return None
        for form in (str, str.strip):
            spans: list[tuple[int, int]] = []
            parts: list[str] = []
            pos = 0
            for k, piece in enumerate(pieces):
                if k % 2:
                    i = int(piece)
                    piece = form(messages[i]["content"]) if i < len(messages) else piece
                    spans.append((pos, pos + len(piece)))
                parts.append(piece)
                pos += len(piece)
            if "".join(parts) == text:
                return spans
        return None
