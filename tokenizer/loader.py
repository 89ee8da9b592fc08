"""Load the served model's tokenizer exactly as the model was trained with it.

transformers converts a GGUF vocabulary into a GPT-2 style byte-level BPE tokenizer, but it drops
the pre-tokenizer rule named by ``tokenizer.ggml.pre``. For ``smollm`` (SmolLM/SmolLM2) the
trained tokenizer splits digits one by one *before* the byte-level regex; without that rule
``'a  1'`` encodes as ``a, Ġ, Ġ, 1`` instead of ``a, ĠĠ, 1``. We restore the rule at load time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

from tokenizers import decoders, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tokenizer.bpe import UnsupportedTokenizer
from tokenizer.budget import TokenBudget
from tokenizer.tools import tool_messages

TokenId = int

# GGUF `tokenizer.ggml.pre` values whose pre-tokenizer transformers does not reproduce, mapped to
# the pre-tokenizer the model was trained with.
_PRE_TOKENIZER_FIXES = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    ),
}


# Byte-level BPE pre-tokenizers that transformers' GGUF conversion keeps as they are: GPT-2's regex.
_GPT2_PRE = ("default", "gpt-2", "gpt2")

# Vocabularies whose trained tokenizer takes a whole pre-tokenized word that is in the vocabulary
# as one token before merging (tokenizer.json's ``ignore_merges``, as llama.cpp's llama-vocab.cpp
# sets it for these ``tokenizer.ggml.pre`` values). transformers' GGUF conversion drops it: Llama
# 3's ``'Cửa Việt'`` then encodes as 5 tokens instead of 3 (llama.cpp's ggml-vocab-llama-bpe test).
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                "midm-2.0", "lfm2", "jina-v5-nano", "tekken"})

# End-of-turn tokens that end generation besides the vocabulary's EOS, when the vocabulary has them
# as special tokens: llama.cpp's end-of-generation list (llama-vocab.cpp). A Qwen2 GGUF's EOS is
# ``<|endoftext|>`` while its chat turns end with ``<|im_end|>``; Llama 3's base EOS is
# ``<|end_of_text|>``, its turns end with ``<|eot_id|>``.
END_OF_TURN_TOKENS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})


class UnsupportedTokenizerError(ValueError):
    """A GGUF's tokenizer that Parrot cannot reproduce exactly as the model was trained with it."""


def gguf_tokenizer_fields(gguf_path: str) -> tuple[str | None, str | None]:
    """``tokenizer.ggml.model`` and ``tokenizer.ggml.pre`` of a GGUF file (None when absent)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields

    def text(key: str) -> str | None:
        field = fields.get(key)
        return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")

    return text("tokenizer.ggml.model"), text("tokenizer.ggml.pre")


def supported_pre_tokenizers() -> set[str]:
    """``tokenizer.ggml.pre`` values of byte-level BPE vocabularies whose pre-tokenizer Parrot
    reproduces: its own fixes, the splits transformers' GGUF conversion sets, and GPT-2's."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # another transformers version: only what Parrot itself knows
        GGUF_PRE_TOKENIZER_SPLITS = {}
    return set(_PRE_TOKENIZER_FIXES) | set(GGUF_PRE_TOKENIZER_SPLITS) | set(_GPT2_PRE)


def check_gguf_tokenizer(model: str | None, pre: str | None) -> None:
    """Raise UnsupportedTokenizerError for a byte-level BPE vocabulary whose pre-tokenizer rule
    Parrot does not know: transformers would fall back to GPT-2's regex, so text would be split
    differently from how the model was trained (as SmolLM2's digit rule was dropped) and token
    counts and outputs would be silently wrong. SentencePiece vocabularies (``llama``) and the
    others transformers converts carry no such rule; transformers refuses those it cannot build."""
    if model == "gpt2" and pre is not None and pre not in supported_pre_tokenizers():
        raise UnsupportedTokenizerError(
            f"the GGUF's tokenizer is byte-level BPE with tokenizer.ggml.pre = {pre!r}, a pre-tokenizer "
            f"Parrot cannot reproduce exactly (supported: {', '.join(sorted(supported_pre_tokenizers()))}); "
            "serve the model's Hugging Face directory (with its tokenizer.json) instead")


@dataclass
class Tokenizer:
    """The served model's tokenizer: exact encode/decode and the chat template, in one place."""

    hf: PreTrainedTokenizerBase
    eos_token_ids: frozenset[TokenId]
    name: str

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[TokenId]:
        """Token ids of ``text`` with no special tokens added (BOS/EOS are the template's job)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[TokenId], skip_special_tokens: bool = True) -> str:
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tools itself (it reads a ``tools`` variable)."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text the model's chat template makes of ``messages`` (OpenAI's, with
        ``tool_calls`` and ``tool`` messages) and ``tools`` (OpenAI tool objects). A template
        without tool support gets them as :func:`tokenizer.tools.tool_messages` renders them."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use a plain prompt instead")
        if self.supports_tools:
            messages = [_arguments_as_objects(m) for m in messages]
        else:
            messages, tools = tool_messages(messages, tools), None
        text = self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt  # type: ignore[arg-type]
        )
        assert isinstance(text, str)
        return text

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[TokenId]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    @property
    def budget(self) -> TokenBudget:
        """Exact token budgeting over this tokenizer (built on first use, then shared; raises
        :class:`~tokenizer.bpe.UnsupportedTokenizer` for a tokenizer it does not implement, and
        remembers that: finding out reads the whole vocabulary)."""
        cached = self.__dict__.get("_budget")
        if cached is None:
            try:
                cached = self.__dict__["_budget"] = TokenBudget(self)
            except UnsupportedTokenizer as exc:
                self.__dict__["_budget"] = exc
                raise
        if isinstance(cached, UnsupportedTokenizer):
            raise cached
        return cached

    def lost_characters(self, text: str) -> list[int]:
        """Offsets of the characters of ``text`` the model does not see as written (bytes without
        a token; see :mod:`tokenizer.bpe`). Beyond the vocabularies the budget implements, known
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
            from tokenizer.bpe import bytes_to_unicode

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


def gguf_add_space_prefix(gguf_path: str) -> bool:
    """``tokenizer.ggml.add_space_prefix`` of a GGUF (true when absent, as llama.cpp reads it)."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.ggml.add_space_prefix")
    return True if field is None else bool(field.parts[field.data[0]][0])


def _fix_sentencepiece(backend: Any, add_space_prefix: bool) -> None:
    """A SentencePiece (``tokenizer.ggml.model = llama``) vocabulary as llama.cpp tokenizes it and
    as Llama 2's and Mistral's own tokenizer.json do: every text segment gets a ``▁`` prepended
    (when ``add_space_prefix``) and spaces become ``▁``. transformers' GGUF conversion uses
    Metaspace with ``prepend_scheme='first'``, which prepends only where the text does not
    already start with a space: ``' Hello'`` became ``[▁Hello]`` instead of ``[▁, ▁Hello]``, and
    every run of leading spaces lost one (15 of llama.cpp's 47 ggml-vocab-llama-spm tests)."""
    steps = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = None
    if not add_space_prefix:  # nothing was prepended, so decoding strips nothing
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])


def end_of_generation_ids(hf: PreTrainedTokenizerBase) -> frozenset[TokenId]:
    """The EOS token and the vocabulary's special end-of-turn tokens (:data:`END_OF_TURN_TOKENS`)."""
    ids = {int(hf.eos_token_id)} if hf.eos_token_id is not None else set()
    for tid, token in getattr(hf, "added_tokens_decoder", {}).items():
        if token.special and token.content in END_OF_TURN_TOKENS:
            ids.add(int(tid))
    return frozenset(ids)


def load_tokenizer(model_dir_or_id: str, gguf_file: str | None = None, saved: bool = False) -> Tokenizer:
    """Load the tokenizer of a local model directory, a GGUF file in it, or a hub id. ``saved``:
    a directory Parrot saved a loaded tokenizer to (the GGUF conversion cache), read with the
    fast tokenizer class it was saved from: ``AutoTokenizer`` would import the model's config
    class, and with it transformers' modelling imports (60 MB resident: torch.distributed.tensor,
    sympy, accelerate) that a GGUF on the kernels never uses."""
    pre = model = None
    if gguf_file is not None:
        model, pre = gguf_tokenizer_fields(os.path.join(model_dir_or_id, gguf_file))
        check_gguf_tokenizer(model, pre)
    if saved:
        hf = PreTrainedTokenizerFast.from_pretrained(model_dir_or_id)
    else:
        hf = AutoTokenizer.from_pretrained(model_dir_or_id, gguf_file=gguf_file)
    if gguf_file is not None:
        fix = _PRE_TOKENIZER_FIXES.get(pre or "")
        if fix is not None:
            backend = hf.backend_tokenizer
            current = json.loads(backend.to_str())["pre_tokenizer"]
            if current is None or current.get("type") == "ByteLevel":
                backend.pre_tokenizer = fix()
        if pre in _IGNORE_MERGES_PRE:
            hf.backend_tokenizer.model.ignore_merges = True
        if model == "llama":
            _fix_sentencepiece(hf.backend_tokenizer, gguf_add_space_prefix(os.path.join(model_dir_or_id, gguf_file)))
    name = os.path.basename(gguf_file or model_dir_or_id.rstrip("/"))
    return Tokenizer(hf=hf, eos_token_ids=end_of_generation_ids(hf), name=name)
