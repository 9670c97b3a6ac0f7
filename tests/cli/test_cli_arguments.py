"""Bad input to ``hf-paged``: one line on stderr naming the flag or the problem, exit status 2, no traceback;
an unexpected error: one line and status 1, or the traceback under ``--verbose``."""

from __future__ import annotations

import io
import socket

import pytest
import torch

import hf_paged
from hf_paged import envs
from hf_paged.attention._dispatch import available_backends
from hf_paged.cache._config import BACKENDS
from hf_paged.cli import _serve, main
from hf_paged.cli.default_model import byte_tokenizer, tiny_llama

GENERATE = ["generate", "--model", "tiny", "--no-progress", "--device", "cpu", "--max-new-tokens", "2"]


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


BAD_FLAGS = [
    (["--model", "/no/such/checkpoint"], ["argument --model", "no such directory"]),
    (["--max-new-tokens", "0"], ["argument --max-new-tokens", "positive integer", "got 0"]),
    (["--max-new-tokens", "-5"], ["argument --max-new-tokens", "got -5"]),
    (["--max-new-tokens", "many"], ["argument --max-new-tokens", "expected an integer"]),
    (["a prompt", ""], ["argument prompts", "empty"]),
    (["--block-size", "0"], ["argument --block-size", "positive integer"]),
    (["--num-blocks", "-1"], ["argument --num-blocks", ">= 0"]),
    (["--top-p", "2"], ["argument --top-p", "(0, 1]"]),
    (["--top-p", "0"], ["argument --top-p", "(0, 1]"]),
    (["--top-k", "-1"], ["argument --top-k", ">= 0"]),
    (["--max-batch-tokens", "0"], ["argument --max-batch-tokens", "positive integer"]),
    (["--temperature", "-1"], ["argument --temperature", ">= 0"]),
    (["--temperature", "nan"], ["argument --temperature", "finite"]),
    (["--seed", "-1"], ["argument --seed", ">= 0"]),
    (["--show", "-1"], ["argument --show", ">= 0"]),
    (["--num-prompts", "0"], ["argument --num-prompts", "positive integer"]),
    (["--backend", "cuda,nonesuch"], ["argument --backend", "'nonesuch'", "torch"]),
    (["--device", "gpu0"], ["argument --device", "unknown device"]),
    (["--dtype", "float64"], ["argument --dtype", "invalid choice"]),
    (["--kv-cache-dtype", "fp16"], ["argument --kv-cache-dtype", "expected auto, fp8 or fp8_e4m3, got 'fp16'"]),
]


@pytest.mark.parametrize("argv, wants", BAD_FLAGS, ids=lambda v: " ".join(v) if isinstance(v[0], str) else None)
def test_a_bad_flag_is_one_line_and_status_2(argv, wants, capsys):
    assert main(GENERATE + argv) == 2
    assert_one_line_error(capsys, "hf-paged generate: error: ", wants)


def assert_one_line_error(capsys, prefix: str, wants: list[str]) -> str:
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(prefix), err
    for want in wants:
        assert want in err, (want, err)
    return err


@pytest.mark.parametrize("name, data, want", [
    ("binary.bin", b"\x89PNG\r\n\x1a\n\xff\xfe", "not UTF-8 text"),
    ("nul.txt", b"a prompt\n\x00\x01\x02\n", "NUL bytes"),
    ("blank.txt", b"\n   \n\n", "holds no prompts"),
])
def test_a_prompts_file_that_holds_no_prompts_is_refused(tmp_path, capsys, name, data, want):
    assert main(GENERATE + ["--prompts-file", write(tmp_path / name, data)]) == 2
    assert_one_line_error(capsys, "hf-paged generate: error: argument --prompts-file: ", [name, want])


def test_a_missing_prompts_file_is_refused(tmp_path, capsys):
    assert main(GENERATE + ["--prompts-file", str(tmp_path / "nope.txt")]) == 2
    assert_one_line_error(capsys, "hf-paged generate: error: argument --prompts-file: ", ["cannot read", "nope.txt"])


def test_a_chat_template_that_cannot_be_read_is_refused(tmp_path, capsys):
    assert main(["serve", "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert_one_line_error(capsys, "hf-paged serve: error: argument --chat-template: cannot read the chat template ",
                          ["none.jinja", "No such file"])
    assert main(["serve", "--chat-template", write(tmp_path / "latin1.jinja", b"caf\xe9")]) == 2
    assert_one_line_error(capsys, "hf-paged serve: error: argument --chat-template: the chat template ",
                          ["latin1.jinja", "is not UTF-8 text (byte 0xe9 at offset 3)"])


@pytest.mark.parametrize("text, want", [("", "holds no prompts"), ("\n\n", "holds no prompts"),
                                        ("a\0b\n", "NUL bytes")])
def test_stdin_that_holds_no_prompts_is_refused(monkeypatch, capsys, text, want):
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert main(GENERATE + ["-"]) == 2
    assert_one_line_error(capsys, "hf-paged generate: error: stdin ('-') ", [want])


class BinaryStdin(io.TextIOWrapper):
    """A stdin whose text layer would pass bytes that are not UTF-8 on as lone surrogates (the C locale)."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")


@pytest.mark.parametrize("stdin", [BinaryStdin(b"ok\nab\xff\xfe cd\n"), io.StringIO("ok\nab\udcff cd\n")],
                         ids=["bytes", "surrogates"])
def test_stdin_that_is_not_utf8_is_one_line_and_status_2(monkeypatch, capsys, stdin):
    """It was an "unexpected TypeError ... please report it" (the tokenizer met the surrogates), status 1."""
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(GENERATE + ["-"]) == 2
    assert_one_line_error(capsys, "hf-paged generate: error: stdin ('-') is not UTF-8 text (byte 0xff at ",
                          ["UTF-8 text"])


@pytest.mark.parametrize("text, said", [("bad \udcff", "byte 0xff at offset 4"),  # (how Python passes on byte 0xff)
                                        ("x\ud800y", "a lone surrogate U+D800 at offset 1")])
def test_a_prompt_argument_that_is_not_utf8_is_refused(capsys, text, said):
    assert main(GENERATE + ["fine", text]) == 2
    assert_one_line_error(capsys, f"hf-paged generate: error: argument prompts: a prompt is not UTF-8 text ({said})",
                          [])


def test_a_prompt_too_long_to_run_is_named_not_echoed_and_status_2(capsys):
    """The 100k-character prompt was echoed in full, its error buried in the summary, status 1."""
    assert main(GENERATE + ["short", "x" * 5000]) == 2
    err = assert_one_line_error(capsys, "hf-paged generate: error: prompt 2 is 5000 tokens long; this engine runs "
                                        "prompts of at most 2047 tokens", ["--num-blocks", "shorten it"])
    assert "xxxxx" not in err
    assert main(GENERATE + ["x" * 40, "--num-blocks", "2", "--block-size", "16"]) == 2
    assert_one_line_error(capsys, "hf-paged generate: error: prompt 1 is 40 tokens long; this engine runs prompts "
                                  "of at most 32 tokens", [])


def test_a_closed_output_ends_quietly_with_status_141(monkeypatch, capsys):
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(GENERATE + ["a prompt"]) == 141
    assert capsys.readouterr().err == ""


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path, capsys):
    assert main(GENERATE + ["--model", str(tmp_path)]) == 2
    assert_one_line_error(capsys, "hf-paged generate: error: argument --model: ", ["no config.json"])
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(GENERATE + ["--model", str(tmp_path)]) == 2
    assert_one_line_error(capsys, f"hf-paged generate: error: --model {tmp_path}: cannot load it: ", ["model_type"])


def test_a_checkpoint_without_tokenizer_files_is_refused_in_one_line(tmp_path, capsys):
    """It was refused after loading the model, blaming sentencepiece; the folder lacks the tokenizer."""
    tiny_llama().save_pretrained(tmp_path)
    capsys.readouterr()  # (save_pretrained's progress bar)
    assert main(GENERATE + ["abc", "--model", str(tmp_path)]) == 2
    err = assert_one_line_error(capsys, "hf-paged generate: error: argument --model: ",
                                [f"'{tmp_path}' has no tokenizer files", "tokenizer.save_pretrained"])
    assert "sentencepiece" not in err
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert_one_line_error(capsys, "hf-paged serve: error: argument --model: ", ["has no tokenizer files"])
    byte_tokenizer().save_pretrained(tmp_path)  # with its tokenizer the same folder runs
    assert main(GENERATE + ["abc", "--model", str(tmp_path)]) == 0


def test_cuda_without_cuda_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(GENERATE + ["--device", "cuda"]) == 2
    assert_one_line_error(capsys, "hf-paged generate: error: argument --device: ", ["'cuda' is not available",
                                                                                     "--device cpu"])


@pytest.mark.parametrize("command", [[*GENERATE, "abc"], ["serve", "--model", "tiny", "--device", "cpu"]])
def test_a_backend_that_cannot_serve_the_device_is_refused(monkeypatch, capsys, command):
    """The engine's refusal of a ``--backend`` list, in the flag's words, from both commands that build an engine."""
    monkeypatch.setattr(_serve, "bind", lambda host, port: socket.create_server((host, 0)))  # (serve: any free port)
    assert main(command + ["--backend", "cuda"]) == 2
    err = assert_one_line_error(capsys, f"hf-paged {command[0]}: error: --backend cuda cannot run this model on cpu (",
                                ["cuda: ", "leave --backend out", "--backend cuda,torch"])
    assert "AttentionCall" not in err and "Phase." not in err and "torch.float32" not in err


def test_the_backend_names_the_flags_accept_are_the_dispatchers():
    """``--backend`` is checked against a constant (parsing imports no torch); it must name what the dispatcher
    registers, in its order."""
    assert list(BACKENDS) == available_backends()


def test_a_value_the_engine_refuses_names_the_flag(capsys):
    assert main(GENERATE + ["abc", "--block-size", "4096"]) == 2
    assert_one_line_error(capsys, "hf-paged generate: error: --block-size must be", ["4096"])


@pytest.mark.parametrize("argv, prefix, wants", [
    (["bench", "kernels", "--head-dims", "abc"], "hf-paged bench kernels: error: argument --head-dims: ", ["'abc'"]),
    (["bench", "kernels", "--head-dims", "128,0"], "hf-paged bench kernels: error: argument --head-dims: ", ["128,0"]),
    (["bench", "kernels", "--json", "/no/such/folder/k.json"], "hf-paged bench kernels: error: argument --json: ",
     ["does not exist"]),
    (["bench"], "hf-paged bench: error: ", ["required", "TARGET"]),
    ([], "hf-paged: error: ", ["required", "COMMAND"]),
    (["no-such-command"], "hf-paged: error: ", ["invalid choice: 'no-such-command'"]),
    (["serve", "--port", "0"], "hf-paged serve: error: argument --port: ", ["must be a positive integer"]),
])
def test_other_commands_refuse_bad_input_the_same_way(capsys, argv, prefix, wants):
    assert main(argv) == 2
    assert_one_line_error(capsys, prefix, wants)


def test_an_unexpected_error_is_one_line_and_status_1_or_a_traceback_when_verbose(monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    for method in ("generate", "step_with_deltas"):  # (with the progress bar, and streaming without it)
        monkeypatch.setattr(hf_paged.Engine, method, boom)
    assert main(GENERATE + ["abc"]) == 1
    out, err = capsys.readouterr()
    assert err == ("hf-paged generate: error: unexpected RuntimeError: boom second line (run again with --verbose "
                   "for the traceback, and please report it)\n")
    with pytest.raises(RuntimeError, match="boom"):
        main(GENERATE + ["abc", "--verbose"])


@pytest.mark.parametrize("key, environment, said", [
    ("", None, ["--api-key is empty", "set a non-empty key", "leave --api-key out"]),
    ("  ", "a-key", ["--api-key is empty", "set a non-empty key", "leave --api-key out"]),
    (None, "", [f"{envs.API_KEY} is empty", "set a non-empty key"]),
    (None, "  ", [f"{envs.API_KEY} is empty", "set a non-empty key"]),
])
def test_an_empty_api_key_is_refused_before_anything_serves(monkeypatch, capsys, key, environment, said):
    """An empty key, given or from the environment, would serve with no key at all: refused before the port is
    bound or the model loaded, whatever the environment holds beside a given key."""
    def no_bind(*args):
        raise AssertionError("the server went on to bind its port")

    monkeypatch.setattr(_serve, "bind", no_bind)
    if environment is None:
        monkeypatch.delenv(envs.API_KEY, raising=False)
    else:
        monkeypatch.setenv(envs.API_KEY, environment)
    envs.refresh()
    try:
        assert main(["serve", "--model", "tiny", "--device", "cpu"] + ([] if key is None else ["--api-key", key])) == 2
    finally:
        monkeypatch.delenv(envs.API_KEY, raising=False)
        envs.refresh()
    assert_one_line_error(capsys, "hf-paged serve: error: ", said)
