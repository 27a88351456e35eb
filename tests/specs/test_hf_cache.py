"""--model ORG/NAME reads config.json from the local Hugging Face cache, never the network."""

import json

import pytest

from trainmem.cli import main
from trainmem.errors import ConfigError
from trainmem.specs.loaders import hf_cache_config, load_config_dict, load_model

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 1000}


def _snapshot(hub, repo, commit, config, mtime=None):
    """The layout huggingface_hub writes: models--ORG--NAME/snapshots/<commit>/config.json."""
    folder = hub / ("models--" + repo.replace("/", "--")) / "snapshots" / commit
    folder.mkdir(parents=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    if mtime is not None:
        import os
        os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def hub(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


def test_refs_main_names_the_snapshot(hub):
    _snapshot(hub, "acme/tiny", "aaa", {**TINY, "num_hidden_layers": 3}, mtime=2_000_000_000)  # newer
    pinned = _snapshot(hub, "acme/tiny", "bbb", TINY, mtime=1_000_000_000)
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text("bbb\n")
    assert hf_cache_config("acme/tiny") == pinned
    assert load_model("acme/tiny").num_layers == 2


def test_without_refs_the_newest_snapshot_wins(hub):
    _snapshot(hub, "acme/tiny", "old", TINY, mtime=1_000_000_000)
    _snapshot(hub, "acme/tiny", "new", {**TINY, "num_hidden_layers": 5}, mtime=2_000_000_000)
    assert load_config_dict("acme/tiny")["num_hidden_layers"] == 5


def test_hf_hub_cache_wins_over_hf_home(hub, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    _snapshot(other, "acme/tiny", "c1", {**TINY, "num_hidden_layers": 7})
    _snapshot(hub, "acme/tiny", "c2", TINY)
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert load_config_dict("acme/tiny")["num_hidden_layers"] == 7


def test_missing_repo_says_how_to_get_the_config(hub, capsys):
    with pytest.raises(ConfigError) as exc:
        load_config_dict("acme/absent")
    assert "huggingface-cli download acme/absent config.json" in str(exc.value)
    assert str(hub) in str(exc.value)
    assert main(["estimate", "--model", "acme/absent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ConfigError: acme/absent: not a local path")


def test_a_local_folder_of_the_same_name_wins(hub, tmp_path, monkeypatch):
    _snapshot(hub, "acme/tiny", "c1", {**TINY, "num_hidden_layers": 7})
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    (tmp_path / "acme" / "tiny" / "config.json").write_text(json.dumps(TINY))
    monkeypatch.chdir(tmp_path)
    assert load_config_dict("acme/tiny")["num_hidden_layers"] == 2


def test_estimate_and_trace_read_the_cache(hub, capsys):
    _snapshot(hub, "acme/tiny", "c1", TINY)
    assert main(["estimate", "--model", "acme/tiny", "--seq", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["model"]["num_layers"] == 2
    assert main(["trace", "--model", "acme/tiny", "--seq", "32", "--json", "--progress", "never"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["model"]["name"] == "acme/tiny"
