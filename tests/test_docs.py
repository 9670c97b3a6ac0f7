"""README.md, docs/ and CHANGELOG.md say what is true: their Python blocks run, the files and commands they name
exist, their generated tables are what their sources give, and the guides carry no history.

How a doc marks a block that cannot run here, and what the blocks' namespace holds: ``docs/guides/testing.md``
("The docs are tested"). The README's two Python blocks run in ``tests/test_readme_snippets.py``."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
CHANGELOG = ROOT / "CHANGELOG.md"
ALL = [README, *DOCS, CHANGELOG]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>[^>]*?) -->\s*$")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ROOTS = ("hf_paged/", "benchmarks/", "tests/", "examples/", "docs/", "integrations/", ".ci/")
SUBPACKAGES = tuple(f"{p.name}/" for p in (ROOT / "hf_paged").iterdir() if p.is_dir() and p.name != "__pycache__")
PATH = re.compile(r"(?<![\w./$~-])((?:%s)[\w.*/-]*)" % "|".join(re.escape(r) for r in ROOTS + SUBPACKAGES))
RESULT_NAME = re.compile(r"^[\w-]+_\d{4}-\d\d-\d\d[\w-]*\.json$")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(doc: Path) -> list[tuple[str, str, str | None]]:
    """(language, code, reason it is not run or None) of each fenced block of ``doc``."""
    text = doc.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        out.append((m.group(1), m.group(2), reason["reason"].strip() if reason else None))
    return out


def prose(doc: Path) -> str:
    return FENCE.sub("", doc.read_text())


# ---------------------------------------------------------------------------------------------------------------
# Python blocks run


@pytest.fixture(scope="module")
def saved_tiny_model(tmp_path_factory):
    from hf_paged.cli.default_model import load_model

    model, tokenizer = load_model("tiny", "cpu", torch.float32, 0)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def namespace(path: Path) -> dict:
    """What every doc's Python blocks start from (docs/guides/testing.md lists it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import hf_paged

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_paged").eval()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    return {"hf_paged": hf_paged, "torch": torch, "AutoModelForCausalLM": AutoModelForCausalLM,
            "AutoTokenizer": AutoTokenizer, "GenerationConfig": GenerationConfig, "path": str(path),
            "model": model, "tokenizer": tokenizer, "prompts": prompts,
            "batch": tokenizer(prompts, return_tensors="pt", padding=True),
            "inputs": [tokenizer.encode(p) for p in prompts],
            "generation_config": GenerationConfig(max_new_tokens=8, do_sample=False)}


RUNNABLE = [doc for doc in DOCS if any(lang == "python" and reason is None for lang, _, reason in blocks(doc))]


@pytest.mark.slow
@pytest.mark.parametrize("doc", RUNNABLE, ids=rel)
def test_the_python_blocks_of_a_doc_run(doc, saved_tiny_model):
    scope = namespace(saved_tiny_model)
    for index, (lang, code, reason) in enumerate(blocks(doc)):
        if lang != "python" or reason is not None:
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"{rel(doc)} block {index + 1}", "exec"), scope)  # noqa: S102


def test_every_block_that_is_not_run_says_why():
    skipped = {}
    for doc in [README, *DOCS]:
        for lang, _, reason in blocks(doc):
            if reason is not None:
                assert reason, f"{rel(doc)}: a <!-- not run: REASON --> marker needs its reason"
                skipped.setdefault(rel(doc), []).append(reason)
    # the guides run what a CPU can: a skip is for a GPU, several processes or a server
    allowed = ("GPU", "GPUs", "launcher", "torchrun", "process", "server")
    for doc, reasons in skipped.items():
        for reason in reasons:
            assert any(word in reason for word in allowed), f"{doc}: not run because {reason!r}?"


# ---------------------------------------------------------------------------------------------------------------
# named files and commands exist


def named_paths(doc: Path) -> set[str]:
    """Repository paths ``doc`` names: in code spans and blocks (from a known root) and as links."""
    text = doc.read_text()
    found = {m.group(1).rstrip(".,;:") for m in PATH.finditer(text)}
    for span in CODE_SPAN.findall(prose(doc)):
        if RESULT_NAME.match(span):  # a result file by its name: the live one, else the archived one
            live = f"benchmarks/results/{span}"
            found.add(live if (ROOT / live).exists() else f"benchmarks/results/archive/{span}")
    for target in LINK.findall(text):
        if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
            found.add(str((doc.parent / target.split("#")[0]).resolve().relative_to(ROOT)))
    # a path from inside the package names a file (``engine/_config.py``); ``cli/server -> ...`` is no path
    found = {p for p in found if p.startswith(ROOTS) or "." in p.rsplit("/", 1)[-1]}
    return {p.split("::")[0] for p in found if not p.endswith("...")}


def exists(path: str) -> bool:
    for candidate in (path, f"hf_paged/{path}"):
        if any(ch in candidate for ch in "*?[") and any(ROOT.glob(candidate)):
            return True
        if (ROOT / candidate).exists():
            return True
    return False


@pytest.mark.parametrize("doc", ALL, ids=rel)
def test_every_file_a_doc_names_exists(doc):
    missing = sorted(p for p in named_paths(doc) if not exists(p))
    assert missing == [], f"{rel(doc)} names files that do not exist: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("doc", ALL, ids=rel)
def test_every_link_to_a_section_finds_it(doc):
    for target in LINK.findall(doc.read_text()):
        if "#" not in target or re.match(r"^[a-z]+:", target):
            continue
        file, anchor = target.split("#", 1)
        linked = (doc.parent / file).resolve() if file else doc
        headings = {slug(h) for h in re.findall(r"^#+ (.+)$", prose(linked), re.M)}
        assert anchor in headings, f"{rel(doc)}: no section #{anchor} in {rel(linked)} (has {sorted(headings)})"


def command_flags(doc: Path) -> list[tuple[str, list[str]]]:
    """(subcommand, flags) of every ``hf-paged ...`` command line ``doc`` shows."""
    out = []
    for m in re.finditer(r"hf-paged ((?:bench )?[a-z-]+)([^`\n|]*)", doc.read_text()):
        out.append((m.group(1), re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2))))
    return out


def help_text(command: str) -> str:
    from hf_paged.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*command.split(), "--help"])
    return out.getvalue()


@pytest.mark.parametrize("doc", [README, *DOCS], ids=rel)
def test_every_command_a_doc_shows_exists(doc):
    helps: dict[str, str] = {}
    for command, flags in command_flags(doc):
        if command == "bench":
            continue  # "hf-paged bench kernels" is matched as "bench kernels"
        if command not in helps:
            helps[command] = help_text(command)
        unknown = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", helps[command])]
        assert unknown == [], f"{rel(doc)}: hf-paged {command} has no {unknown}"


# ---------------------------------------------------------------------------------------------------------------
# generated tables, history, length


def test_the_generated_tables_are_what_their_sources_give():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        tables = runpy.run_path(str(ROOT / "docs" / "tables.py"), run_name="docs_tables")
    finally:
        sys.path.remove(str(ROOT / "docs"))
    assert tables["stale"]() == [], "run: python docs/tables.py"
    kinds = {spec.split()[0] for doc in tables["documents"]() for spec in tables["specs"](doc)}
    assert {"e2e", "envs", "engine-config", "results"} <= kinds


def test_the_readme_benchmark_table_has_its_baseline_in_the_same_run():
    spec = re.search(r"<!-- table: e2e (\S+) -->", README.read_text())
    assert spec, "the README's benchmark table is generated (<!-- table: e2e FILE -->)"
    import json

    rows = json.loads((ROOT / spec.group(1)).read_text())["rows"]
    assert {r["system"] for r in rows} >= {"hf_paged", "transformers"}
    assert len({(r.get("card"), r.get("date"), r.get("transformers")) for r in rows}) == 1  # one run


HISTORY = re.compile(r"\b(?:rounds?(?! trips?)(?! to)|sessions?|re-?runs?|earlier calls?|issues? \d+|item \d+)\b",
                     re.I)
DATE = re.compile(r"(?<!\d)20\d\d-\d\d-\d\d(?!\d)")  # a day, alone or in a result file's name
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/.-])")


@pytest.mark.parametrize("doc", [README, *GUIDES], ids=rel)
def test_the_guides_and_the_readme_carry_no_history(doc):
    text = prose(doc)
    assert HISTORY.findall(text) == [], f"{rel(doc)}: history goes to CHANGELOG.md"


@pytest.mark.parametrize("doc", GUIDES, ids=rel)
def test_the_guides_carry_no_dates(doc):
    """A guide says what is true now; a measurement's date (and its result file) belongs to the benchmarks page,
    the decisions or the CHANGELOG."""
    assert DATE.findall(doc.read_text()) == [], f"{rel(doc)}: dates go to docs/benchmarks.md or CHANGELOG.md"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=rel)
def test_no_doc_names_a_tracker_item_or_a_commit(doc):
    text = doc.read_text()
    assert re.findall(r"\bissues? \d+|\bitem \d+", text, re.I) == []
    assert COMMIT.findall(text) == [], f"{rel(doc)}: commit hashes go nowhere in docs"


def test_the_readme_is_a_short_guide():
    text = README.read_text()
    assert len(text.splitlines()) < 130
    for needed in ("pip install", "python -m pytest -q", '-m "not slow"', "hf-paged serve", "Engine",
                   "generate_batch", "minutes"):
        assert needed in text


def test_the_history_check_finds_history():
    assert HISTORY.findall("In the sixth round, a re-run of issue 12 in this session") == [
        "round", "re-run", "issue 12", "session"]
    assert HISTORY.findall("one round trip; round to nearest even") == []
    assert COMMIT.findall("at commit 14a3f2f, not a word like decade or 2026-11-26") == ["14a3f2f"]
    assert DATE.findall("on 2026-11-26 (`e2e_h200_2026-11-28_cb.json`), not 2026-11 or 12026-11-260") == [
        "2026-11-26", "2026-11-28"]
