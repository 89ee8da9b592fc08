"""Configuration: defaults < TOML file < PARROT_<SECTION>_<KEY> environment < flags."""

from __future__ import annotations

import pytest

from parrot.config import load_config


def test_defaults_come_from_configs_default_toml():
    config = load_config(env={})
    assert config.model.source == "embedded" and config.model.dtype == "auto"
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.drafting.method == "suffix" and config.drafting.adaptive


def test_file_then_environment_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 9000\nmax_queue = 5\n[drafting]\nmax_draft = 4\n')
    config = load_config(path, env={"PARROT_SERVER_PORT": "9100", "PARROT_DRAFTING_ENABLED": "false"},
                         overrides={"server": {"port": 9200, "host": None}})
    assert config.server.port == 9200  # flag beats environment beats file
    assert config.server.max_queue == 5 and config.server.host == "127.0.0.1"
    assert config.drafting.max_draft == 4 and config.drafting.enabled is False


@pytest.mark.parametrize("text, message", [
    ("[server]\nprot = 1\n", "unknown keys in \\[server\\]: prot"),
    ("[serve]\nport = 1\n", "unknown sections: serve"),
    ("[server]\nport = 'x'\n", "server.port: expected int"),
    ("[model]\ndtype = 'int3'\n", "model.dtype must be one of"),
    ("[drafting]\nmin_n = 5\nmax_n = 2\n", "min_n <= max_n"),
    ("[server\n", "c.toml"),
])
def test_bad_config_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path, env={})


def test_bad_environment_value_names_the_setting():
    with pytest.raises(ValueError, match="server.port: expected int, got 'eighty'"):
        load_config(env={"PARROT_SERVER_PORT": "eighty"})


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nope.toml", env={})
