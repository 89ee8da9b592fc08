"""Grammar state for constrained decoding (llguidance), and canonical fast-forward tokens.

``GrammarCompiler`` turns a request's constraint (JSON schema, regex, choice list, Lark grammar)
into an llguidance grammar, validates it against the served tokenizer (an invalid grammar is a
``GrammarError`` quoting llguidance's message) and caches compiled grammars. ``Grammar`` is the
state of one request, with verbs that say what happens to it:

- ``forced_tokens()``: tokens the grammar allows as the only continuation (fast-forward);
- ``spelled_forced()``: the forced bytes that fast-forward left out, spelled as tokens (a draft);
- ``validate(tokens)``: how many of ``tokens`` the grammar allows from here (drafts are cut there);
- ``masks(draft)``: the allowed-token bitmask at every verified position;
- ``consume(tokens)`` / ``rollback(n)``.

Fast-forward tokens must be canonical (llguidance ``docs/fast_forward.md``): the forced *bytes*
are certain, but their tokenization is not, since the text that follows can merge with the end
of the forced bytes into a longer token (forcing ``":"`` as three tokens when the model would
write ``":"`` followed by ``"Paris`` as ``":"`` + ``"Par`` ...). llguidance already backs off the
last tokens of the forced bytes; ``canonical_prefix`` checks its answer against the served
tokenizer and backs off further (up to ``MAX_BACKOFF`` tokens) while (a) the tokens do not
re-encode to themselves, or (b) some vocabulary token starts with the last forced token's bytes
and runs past them consistently with the rest of the forced bytes, i.e. a longer token could
span the end of what we would force.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from typing import Any

from parrot.constrain.tools import tool_grammar
from parrot.tokenizer.loader import Tokenizer
from parrot.tokenizer.tool_format import CLOSE_TAG, OPEN_TAG

TokenId = int
MAX_BACKOFF = 4
# llguidance's options for JSON schemas with keywords a grammar cannot enforce: compile what it
# can (unimplemented keywords and unknown formats are ignored, oneOf is read as anyOf) and warn.
LENIENT: Any = {"lenient": True, "coerce_one_of": True}


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message is llguidance's."""


class TokenBytes:
    """Byte strings of every token, sorted, to find the tokens that extend a given one."""

    def __init__(self, tokenizer: Tokenizer, llg_tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        n = llg_tokenizer.vocab_size
        self.bytes_of = [llg_tokenizer.decode_bytes([t]) for t in range(n)]
        special = {t for t in range(n) if llg_tokenizer.is_special_token(t)}
        self.sorted = sorted(b for t, b in enumerate(self.bytes_of) if b and t not in special)

    def has_longer_token(self, head: bytes, rest: bytes) -> bool:
        """Whether a token starts with ``head`` + at least one byte, those bytes agreeing with ``rest``."""
        i = bisect.bisect_right(self.sorted, head)
        while i < len(self.sorted) and self.sorted[i].startswith(head):
            extra = self.sorted[i][len(head) :]
            if extra and (rest.startswith(extra) or extra.startswith(rest)):
                return True
            i += 1
        return False


def canonical_prefix(tokens: list[TokenId], forced_bytes: bytes, index: TokenBytes) -> list[TokenId]:
    """The longest prefix of ``tokens`` (within MAX_BACKOFF of the end) that is safe to force."""
    if not tokens:
        return []
    floor = max(len(tokens) - MAX_BACKOFF, 0)
    for keep in range(len(tokens), floor, -1):
        candidate = tokens[:keep]
        text = index.tokenizer.decode(candidate, skip_special_tokens=False)
        if index.tokenizer.encode(text) != candidate:
            continue
        covered = sum(len(index.bytes_of[t]) for t in candidate)
        if index.has_longer_token(index.bytes_of[candidate[-1]], forced_bytes[covered:]):
            continue
        return candidate
    return []


class Grammar:
    """The grammar state of one request (wraps an llguidance ``LLMatcher``)."""

    def __init__(self, matcher: Any, index: TokenBytes, fast_forward: bool = True) -> None:
        self.matcher = matcher
        self.index = index
        self.fast_forward = fast_forward
        # Forced bytes -> the token the model began them with last time (see spelled_forced).
        self._spellings: dict[bytes, TokenId] = {}
        self._spelling_asked: bytes | None = None

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())

    @property
    def stopped(self) -> bool:
        """No token but EOS can follow: the constrained output is complete."""
        return bool(self.matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def forced_tokens(self) -> list[TokenId]:
        """Canonical fast-forward tokens from the current state ([] when off or none)."""
        if not self.fast_forward or self.stopped:
            return []
        tokens = list(self.matcher.compute_ff_tokens())
        # llguidance spells the forced bytes with the tokenizer, which reads text such as
        # "<tool_call>" as an added token that the grammar's text does not match: never force
        # what the grammar itself would refuse.
        tokens = tokens[: int(self.matcher.validate_tokens(tokens))] if tokens else []
        if not tokens:
            return []
        return canonical_prefix(tokens, self.matcher.compute_ff_bytes(), self.index)

    def spelled_forced(self) -> list[TokenId]:
        """The bytes the grammar forces next, spelled as tokens; [] if none.

        Call after consuming ``forced_tokens()``: what is left is what the canonical back-off held
        back (``"`` before a string value, ``":"`` after a key). Their tokens are likely but not
        certain, since the model may merge the last of them with the text that follows, so the
        engine drafts them (verified like any draft), never forces them. The spelling is the
        model's own when it has begun the same bytes before in this request (it writes ``":``
        then ``"`` where the tokenizer would write ``":"``), else the tokenizer's.
        """
        if not self.fast_forward or self.stopped:
            return []
        data = bytes(self.matcher.compute_ff_bytes())
        if not data:
            return []
        self._spelling_asked = data  # the next consumed token shows how the model begins them
        first = self._spellings.get(data)
        head = [first] if first is not None else []
        rest = data[len(self.index.bytes_of[first]) :] if first is not None else data
        text = rest.decode("utf-8", errors="ignore")  # drops a character cut at the end
        tokens = head + (self.index.tokenizer.encode(text) if text else [])
        return tokens[: self.validate(tokens)]

    def validate(self, tokens: list[TokenId]) -> int:
        """How many of ``tokens`` (a prefix) the grammar allows from the current state, EOS
        excluded: llguidance allows EOS where the grammar may end, but once the grammar is
        complete its matcher consumes nothing more (so ``masks`` could not step over it), and the
        output ends there anyway: the pass yields that EOS as its own token if the model wants it."""
        allowed = int(self.matcher.validate_tokens(tokens)) if tokens else 0
        eos = self.index.tokenizer.eos_token_ids
        return next((i for i, token in enumerate(tokens[:allowed]) if token in eos), allowed)

    def consume(self, tokens: list[TokenId]) -> None:
        if tokens and self._spelling_asked is not None:
            data, self._spelling_asked = self._spelling_asked, None
            if data.startswith(self.index.bytes_of[tokens[0]]):
                self._spellings[data] = tokens[0]
        self._advance(tokens)

    def _advance(self, tokens: list[TokenId]) -> None:
        if tokens and not self.matcher.consume_tokens(tokens):
            self._check()
            raise GrammarError("the grammar rejected a token it had allowed")

    def rollback(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            raise GrammarError(f"cannot roll the grammar back by {n} tokens")

    def masks(self, draft: list[TokenId]) -> list[bytes]:
        """Bitmasks (bit i of byte i // 8 = token i allowed) after draft[:0], ..., draft[:len].

        The state is unchanged afterwards. ``draft`` must be allowed (see ``validate``).
        """
        masks = [self.matcher.compute_bitmask()]
        for token in draft:
            self._advance([token])
            masks.append(self.matcher.compute_bitmask())
        self.rollback(len(draft))
        return masks


class GrammarCompiler:
    """Compiles constraints for one tokenizer; compiled grammars are cached (thread-safe)."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 256) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.tokenizer = tokenizer
        hf: Any = tokenizer.hf  # a fast (tokenizers-backed) tokenizer
        self.llg_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=tokenizer.vocab_size)
        self.index = TokenBytes(tokenizer, self.llg_tokenizer)
        self.tag_tokens = self._tag_tokens()
        # grammar text -> (a pristine matcher, deep-copied for each request as that is cheaper than
        # compiling; llguidance's warnings)
        self._cache: OrderedDict[str, tuple[Any, tuple[str, ...]]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _tag_tokens(self) -> dict[str, int]:
        """The tool-call tags this vocabulary holds as one added token whose text decoding keeps
        (not a special token to the tokenizer), by tag: the model writes them as that token."""
        found = {}
        for tag in (OPEN_TAG, CLOSE_TAG):
            ids = self.tokenizer.encode(tag)
            if len(ids) == 1 and self.llg_tokenizer.is_special_token(ids[0]) and self.tokenizer.decode(ids) == tag:
                found[tag] = ids[0]
        return found

    def grammar_text(self, kind: str, spec: Any, lenient: bool = False) -> str:
        """llguidance grammar for ``kind`` in json_schema | regex | choice | lark | tools (spec:
        ``functions``, ``required``, ``parallel`` of ``tool_grammar``); ``lenient``: a JSON
        schema's keywords the grammar cannot enforce are left out (``unenforced`` says which)."""
        M = self._llg.LLMatcher
        try:
            if kind == "tools":
                return tool_grammar(spec["functions"], spec["required"], spec["parallel"], self.tag_tokens)
            if kind == "json_schema":
                schema = json.loads(spec) if isinstance(spec, str) else spec
                # Compact separators: more of the output is forced, and small models cannot wander
                # off into endless whitespace.
                return M.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False},
                                                  overrides=LENIENT if lenient else None)
            if kind == "regex":
                return M.grammar_from_regex(spec)
            if kind == "choice":
                choices = [str(c) for c in spec]
                if not choices:
                    raise GrammarError("guided_choice needs at least one choice")
                return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
            if kind == "lark":
                return M.grammar_from_lark(spec)
        except (ValueError, TypeError) as exc:
            raise GrammarError(str(exc)) from None
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def compile(self, kind: str, spec: Any, lenient: bool = False) -> str:
        """A validated grammar text; GrammarError with llguidance's message if it is invalid."""
        text = self.grammar_text(kind, spec, lenient)
        self._template(text)
        return text

    def unenforced(self, grammar_text: str) -> list[str]:
        """llguidance's warnings about a compiled grammar: for a lenient JSON schema, the keywords
        and formats it does not enforce (``Unimplemented keys: ["not"]``, ``Unknown format: ...``)."""
        return list(self._template(grammar_text)[1])

    def _template(self, text: str) -> tuple[Any, tuple[str, ...]]:
        """The pristine matcher of a grammar and llguidance's warnings about it (cached)."""
        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                return self._cache[text]
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(text, self.llg_tokenizer)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")
        matcher = self._llg.LLMatcher(self.llg_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._cache[text] = (matcher, tuple(messages))
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher, tuple(messages)

    def new_state(self, grammar_text: str, fast_forward: bool = True) -> Grammar:
        """A fresh grammar state for one request."""
        return Grammar(self._template(grammar_text)[0].deep_copy(), self.index, fast_forward)
