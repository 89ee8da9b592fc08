"""Load the served model's tokenizer exactly as the model was trained with it: a model
directory's own, or a GGUF's as transformers converts it with Parrot's fixes
(:mod:`parrot.tokenizer.gguf_vocab`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Sequence

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from parrot.tokenizer.bpe import UnsupportedTokenizer
from parrot.tokenizer.budget import TokenBudget
from parrot.tokenizer.general import GeneralBudget
from parrot.tokenizer.gguf_vocab import GGUFVocabulary, UnsupportedTokenizerError, check_gguf_tokenizer, fix_gguf_tokenizer
from parrot.tokenizer.tool_format import tool_messages

__all__ = ["END_OF_TURN_TOKENS", "TokenId", "Tokenizer", "UnsupportedTokenizerError", "load_tokenizer"]

TokenId = int

# End-of-turn tokens that end generation besides the vocabulary's EOS, when the vocabulary has them
# as special tokens: llama.cpp's end-of-generation list (llama-vocab.cpp). A Qwen2 GGUF's EOS is
# ``<|endoftext|>`` while its chat turns end with ``<|im_end|>``; Llama 3's base EOS is
# ``<|end_of_text|>``, its turns end with ``<|eot_id|>``.
END_OF_TURN_TOKENS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})


@dataclass
class Tokenizer:
    """The served model's tokenizer: exact encode/decode and the chat template, in one place."""

    hf: PreTrainedTokenizerBase
    eos_token_ids: frozenset[TokenId]
    name: str

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[TokenId]:
        """Token ids of ``text``; with no special tokens added unless asked (in a chat, BOS/EOS
        are the template's job; a completion's prompt gets the vocabulary's own, as vLLM's)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[TokenId], skip_special_tokens: bool = True) -> str:
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text

    @property
    def decodes_incrementally(self) -> bool:
        """Whether generated text may be decoded a window of tokens at a time
        (parrot/engine/textout.py): not where transformers cleans up spaces around punctuation
        after decoding (WordPiece-era tokenizers), which can reach across any cut."""
        return not getattr(self.hf, "clean_up_tokenization_spaces", False)

    def text_may_change(self, ids: Sequence[TokenId]) -> bool:
        """Whether the next token can change text ``ids`` already decode to (other than a last
        incomplete UTF-8 character, which decodes to U+FFFD): with byte fallback (SentencePiece
        vocabularies), a run of <0xXX> tokens is decoded as one UTF-8 text, and every byte of an
        invalid run becomes U+FFFD, so '1' (<0x31>) followed by <0x80> decodes to two U+FFFD.
        True while the last token that is not a skipped special token is a byte token."""
        byte_tokens, specials = self._byte_tokens()
        for token in reversed(ids):
            if token not in specials:
                return token in byte_tokens
        return False

    def _byte_tokens(self) -> tuple[frozenset[TokenId], frozenset[TokenId]]:
        cached = self.__dict__.get("_byte_token_ids")
        if cached is None:
            backend = getattr(self.hf, "backend_tokenizer", None)
            byte_tokens: frozenset[TokenId] = frozenset()
            if backend is not None and getattr(backend.model, "byte_fallback", False):
                ids = (self.hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256))
                byte_tokens = frozenset(i for i in ids if isinstance(i, int) and i != self.hf.unk_token_id)
            specials = frozenset(getattr(self.hf, "all_special_ids", ()))
            if backend is not None:
                specials |= frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
            cached = self.__dict__["_byte_token_ids"] = (byte_tokens, specials)
        return cached

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tools itself (it reads a ``tools`` variable)."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text the model's chat template makes of ``messages`` (OpenAI's, with
        ``tool_calls`` and ``tool`` messages) and ``tools`` (OpenAI tool objects). A template
        without tool support gets them as :func:`parrot.tokenizer.tool_format.tool_messages` renders them."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use a plain prompt (/v1/completions), or start the "
                             "server with one (--chat-template FILE, model.chat_template)")
        if self.supports_tools:
            messages = [_arguments_as_objects(m) for m in messages]
        else:
            messages, tools = tool_messages(messages, tools), None
        text = self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt  # type: ignore[arg-type]
        )
        assert isinstance(text, str)
        return text

    def use_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (Jinja, as in a tokenizer_config.json) instead of the
        model's own, or where the model has none (a base model's GGUF); ValueError if it cannot
        render a one-message chat."""
        before = getattr(self.hf, "chat_template", None)
        self.hf.chat_template = template
        try:
            self.render_chat([{"role": "user", "content": "Hello"}])
        except Exception as exc:
            self.hf.chat_template = before
            raise ValueError(f"the chat template given cannot render a chat: {type(exc).__name__}: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[TokenId]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    @property
    def budget(self) -> TokenBudget | GeneralBudget:
        """Exact token budgeting over this tokenizer (built on first use, then shared; raises
        :class:`~parrot.tokenizer.bpe.UnsupportedTokenizer` for a tokenizer it does not implement, and
        remembers that: finding out reads the whole vocabulary)."""
        cached = self.__dict__.get("_budget")
        if cached is None:
            try:
                cached = self.__dict__["_budget"] = TokenBudget(self)
            except UnsupportedTokenizer:
                try:
                    cached = self.__dict__["_budget"] = GeneralBudget(self)
                except UnsupportedTokenizer as exc:
                    self.__dict__["_budget"] = exc
                    raise
        if isinstance(cached, UnsupportedTokenizer):
            raise cached
        return cached

    def lost_characters(self, text: str) -> list[int]:
        """Offsets of the characters of ``text`` the model does not see as written (bytes without
        a token; see :mod:`parrot.tokenizer.bpe`). Beyond the vocabularies the budget implements, known
        for those with a token for every byte (none lost); else UnsupportedTokenizer."""
        try:
            return self.budget.lost_characters(text)
        except UnsupportedTokenizer:
            if self.covers_every_byte:
                return []
            raise

    @property
    def covers_every_byte(self) -> bool:
        """Whether every byte has a token: byte-level BPE with all 256 byte characters (Llama 3,
        Qwen2), or byte fallback with all 256 ``<0xXX>`` tokens (SentencePiece vocabularies)."""
        cached = self.__dict__.get("_covers_every_byte")
        if cached is None:
            from parrot.tokenizer.bpe import bytes_to_unicode

            vocab = self.hf.get_vocab()
            byte_level = all(c in vocab for c in bytes_to_unicode().values())
            fallback = bool(getattr(self.hf.backend_tokenizer.model, "byte_fallback", False)) and all(
                f"<0x{b:02X}>" in vocab for b in range(256))
            cached = self.__dict__["_covers_every_byte"] = byte_level or fallback
        return cached


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose tool calls' arguments are objects, as chat templates expect (OpenAI sends
    JSON text); arguments that do not parse stay text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (ValueError, TypeError):
            arguments = call["function"]["arguments"]
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": calls}


def end_of_generation_ids(hf: PreTrainedTokenizerBase) -> frozenset[TokenId]:
    """The EOS token and the vocabulary's special end-of-turn tokens (:data:`END_OF_TURN_TOKENS`)."""
    ids = {int(hf.eos_token_id)} if hf.eos_token_id is not None else set()
    for tid, token in getattr(hf, "added_tokens_decoder", {}).items():
        if token.special and token.content in END_OF_TURN_TOKENS:
            ids.add(int(tid))
    return frozenset(ids)


def write_merges_as_strings(tokenizer_json: str) -> bool:
    """Rewrite a saved ``tokenizer.json``'s BPE merges from pairs (``["a", "b"]``, what
    tokenizers writes) to ``"a b"`` strings, its older form, which it reads to the same model.
    Read as pairs, the embedded model's 48,900 merges leave 2.3 MB more resident memory (13.6 MB
    against 11.3 for the whole tokenizer): tokenizers holds a buffered copy of every merge while
    building the model, and what it frees is scattered among what it keeps. A vocabulary with a
    space inside a merge's part keeps the pairs (the string form cannot hold it). Returns whether
    the file was rewritten."""
    with open(tokenizer_json, encoding="utf-8") as f:
        data = json.load(f)
    model = data.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or not all(
        isinstance(m, list) and len(m) == 2 and " " not in m[0] and " " not in m[1] for m in merges
    ):
        return False
    model["merges"] = [f"{a} {b}" for a, b in merges]
    with open(tokenizer_json, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    return True


def read_chat_template(value: str) -> str:
    """``model.chat_template``: a Jinja file's path, or the template itself (as vLLM's
    ``--chat-template`` takes either); ValueError naming a file that is not there."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"model.chat_template: no file {value!r} (give a Jinja chat template's path, or the template)")
    return path.read_text(encoding="utf-8")


def load_tokenizer(model_dir_or_id: str, gguf_file: str | None = None, saved: bool = False) -> Tokenizer:
    """Load the tokenizer of a local model directory, a GGUF file in it, or a hub id. ``saved``:
    a directory Parrot saved a loaded tokenizer to (the GGUF conversion cache), read with the
    fast tokenizer class it was saved from: ``AutoTokenizer`` would import the model's config
    class, and with it transformers' modelling imports (60 MB resident: torch.distributed.tensor,
    sympy, accelerate) that a GGUF on the kernels never uses."""
    vocabulary = None
    if gguf_file is not None:
        vocabulary = GGUFVocabulary.read(os.path.join(model_dir_or_id, gguf_file))
        check_gguf_tokenizer(vocabulary.model, vocabulary.pre)
    if saved:
        hf = PreTrainedTokenizerFast.from_pretrained(model_dir_or_id)
    else:
        hf = AutoTokenizer.from_pretrained(model_dir_or_id, gguf_file=gguf_file)
    if vocabulary is not None:
        fix_gguf_tokenizer(hf, vocabulary)
    name = os.path.basename(gguf_file or model_dir_or_id.rstrip("/"))
    return Tokenizer(hf=hf, eos_token_ids=end_of_generation_ids(hf), name=name)
