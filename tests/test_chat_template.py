"""A chat template given to the server (``--chat-template``, ``model.chat_template``): for a model
whose files have none (a base model's GGUF, as Gemma 3 270M's) or to replace its own."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from parrot import cli
from parrot.tokenizer.loader import read_chat_template

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture
def tokenizer(embedded_tokenizer):
    """A copy of the embedded tokenizer (its template changes here)."""
    return dataclasses.replace(embedded_tokenizer, hf=copy.deepcopy(embedded_tokenizer.hf))


def test_the_template_is_a_file_or_the_text_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert read_chat_template(str(path)) == TEMPLATE == read_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="no file 'missing.jinja'"):
        read_chat_template("missing.jinja")


def test_a_model_without_a_template_gets_one_and_a_given_one_replaces_the_models(tokenizer):
    own = tokenizer.render_chat(CHAT)
    tokenizer.hf.chat_template = None  # as a base model's GGUF
    with pytest.raises(ValueError, match="no chat template.*--chat-template"):
        tokenizer.render_chat(CHAT)
    tokenizer.use_chat_template(TEMPLATE)
    assert tokenizer.render_chat(CHAT) == "<<system>> Be brief.\n<<user>> Hi\n<<assistant>> " != own
    assert tokenizer.encode_chat(CHAT) == tokenizer.encode("<<system>> Be brief.\n<<user>> Hi\n<<assistant>> ")


def test_a_template_that_cannot_render_is_refused_and_the_old_one_kept(tokenizer):
    own = tokenizer.render_chat(CHAT)
    for broken in ("{% for m in messages %}{{ m['content'] }}", "{{ raise_exception('no chats here') }}"):
        with pytest.raises(ValueError, match="cannot render a chat"):
            tokenizer.use_chat_template(broken)
        assert tokenizer.render_chat(CHAT) == own


def test_serve_says_when_the_template_file_is_missing(capsys, tmp_path):
    assert cli.main(["serve", "--chat-template", str(tmp_path / "none.jinja"), "--port", "0"]) == 2
    assert "model.chat_template: no file" in capsys.readouterr().err
