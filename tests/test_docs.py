"""The documentation: the site builds with --strict (no broken links or missing pages), every config
key and knob is described (the configuration page is generated from them), and the worked example
of docs/writing-a-method.md runs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_key_and_knob_has_a_description():
    from fedlt.docs_config import missing_descriptions

    missing = missing_descriptions()
    assert not missing, f"add description= to these fields (they document the configuration page): {missing}"


def test_configuration_page_lists_every_key_with_type_and_default():
    from fedlt.docs_config import config_keys, render

    page = render()
    keys = config_keys()
    assert len(keys) > 50
    for key, _ in keys:
        assert f"| `{key}` |" in page, key
    assert "| `data.class_order` | `\"natural\" \\| \"shuffled\" \\| list[int]` | `natural` |" in page
    assert "| `fl.participation` | `float in (0, 1]` | `0.4` |" in page
    assert "| `method_args.mu` |" in page and "| `calibration_args.creff_feature_steps` |" in page


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (pip install -e '.[docs]'; scripts/setup.sh installs it)")
def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    config_page = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert "data.class_order" in config_page and "secagg.fraction_bits" in config_page


def test_writing_a_method_example_runs(tmp_path, monkeypatch):
    import fedlt
    from fedlt.errors import ConfigError
    from fedlt.methods.registry import METHODS

    spec = importlib.util.spec_from_file_location("logit_squeeze", ROOT / "docs" / "examples" / "logit_squeeze.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setitem(METHODS, example.SPEC.name, example.SPEC)

    result = fedlt.run({"method": "squeeze", "method_args": {"beta": 0.05},
                        "data": {"dataset": "synthetic", "num_clients": 4}, "fl": {"rounds": 1, "local_epochs": 1},
                        "eval": {"personalized": False}, "run": {"out_dir": str(tmp_path), "threads": 1}},
                       quiet=True)
    assert result.summary["final"]["server_metrics"]["head_row_norm"] > 0
    assert 0 <= result.summary["final"]["acc"] <= 100
    with pytest.raises(ConfigError, match="has no knob method_args.gamma"):
        fedlt.run({"method": "squeeze", "method_args": {"gamma": 1}, "data": {"dataset": "synthetic"}}, quiet=True)


def test_readme_is_short_and_its_links_resolve():
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024, "README.md is over 12 KB: move the detail into a page under docs/"
    for doc in (readme, (ROOT / "CONTRIBUTING.md").read_text()):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc):
            assert target.startswith("http") or (ROOT / target).exists(), target


#: abbreviations of general computing, which the glossary does not define
COMMON_ABBREVIATIONS = {"AES-256", "AI", "AMD", "API", "CA", "CI", "CLI", "CONTRIBUTING", "CPU", "CSV", "CTR", "CUDA", "DNS",
                        "EC", "ECDH", "EPYC", "ETA", "GPU", "H100", "H200", "HKDF", "II", "IP", "JSON", "NIST", "NOT", "PIL", "PORT",
                        "PRIVATE", "README", "RNG", "SHA-256", "SIGINT", "SIGTERM", "TOML", "YAML"}


def test_the_glossary_defines_every_abbreviation_of_the_readme_and_the_docs():
    """An all-caps word in the prose of the README or a docs page (not in code) is a glossary
    headword, each part of a hyphenated one too (MNIST-LT: MNIST, LT), or common computing."""
    import re

    glossary = (ROOT / "docs" / "glossary.md").read_text()
    heads = {part.strip() for m in re.finditer(r"\*\*(.+?)\*\*", glossary) for part in re.split(r"[,/]", m.group(1))}
    known = heads | COMMON_ABBREVIATIONS
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "methods").glob("*.md"))]
    missing = {}
    for page in pages:
        prose = re.sub(r"`[^`]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
        for word in re.findall(r"\b[A-Z][A-Z0-9]+(?:-[A-Za-z0-9]+)?\b", prose):
            parts = [word] if word in known else [p for p in word.split("-") if p.isupper() and len(p) > 1]
            if not all(p in known for p in parts):
                missing.setdefault(word, page.name)
    assert not missing, f"define these in docs/glossary.md (word: first page): {missing}"
    assert "[glossary](docs/glossary.md)" in (ROOT / "README.md").read_text()
    entries = [m.group(1) for m in re.finditer(r"^\*\*(.+?)\*\*", glossary, flags=re.M)]
    key = [re.sub(r"[^a-z0-9]", "", e.lower()) for e in entries]
    assert key == sorted(key), "glossary entries in alphabetical order"


#: the opening line of every results and method page (its form: docs/results/index.md)
PROVENANCE_LABELS = ("**Protocol:**", "**Defaults:**", "**Runs:**")


def _paragraphs_after_title(text: str) -> list[str]:
    """The page's paragraphs after its first heading (blank-line separated, code fences kept whole)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# ")) + 1
    return [p.strip() for p in "\n".join(lines[start:]).split("\n\n") if p.strip()]


def _provenance_block(text: str) -> str | None:
    """The blockquote right after the title that starts with **Protocol:**, as one line, or None."""
    paragraphs = _paragraphs_after_title(text)
    if not paragraphs or not paragraphs[0].startswith("> " + PROVENANCE_LABELS[0]):
        return None
    lines = paragraphs[0].splitlines()
    if not all(line.startswith(">") for line in lines):
        return None
    return " ".join(line[1:].strip() for line in lines)


def test_every_results_and_method_page_states_its_protocol_defaults_and_code_version():
    """Right after the title: `> **Protocol:** ... | **Defaults:** ... | **Runs:** ...`, the runs
    named by git commit (or "no measured figures")."""
    import re

    pages = [*sorted((ROOT / "docs" / "results").glob("*.md")), *sorted((ROOT / "docs" / "methods").glob("*.md"))]
    assert len(pages) > 15
    problems = {}
    for page in pages:
        rel = page.relative_to(ROOT).as_posix()
        if page.name == "index.md":
            continue
        block = _provenance_block(page.read_text())
        if block is None:
            problems[rel] = "no '> **Protocol:** ...' block right after the title"
            continue
        at = [block.find(label) for label in PROVENANCE_LABELS]
        if min(at) < 0 or at != sorted(at):
            problems[rel] = f"the block names {', '.join(PROVENANCE_LABELS)} in this order"
            continue
        runs = block[at[2]:]
        if not (re.search(r"\b[0-9a-f]{7,40}\b", runs) or "no measured figures" in runs):
            problems[rel] = "**Runs:** names no git commit (nor says 'no measured figures')"
    assert not problems, problems


def _nav() -> list:
    import yaml

    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]


def _nav_pages(entry) -> list[str]:
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, list):
        return [page for item in entry for page in _nav_pages(item)]
    return [page for value in entry.values() for page in _nav_pages(value)]


def _nav_group(entry, title: str):
    if isinstance(entry, list):
        for item in entry:
            if (found := _nav_group(item, title)) is not None:
                return found
    elif isinstance(entry, dict):
        for key, value in entry.items():
            if key == title:
                return value
            if (found := _nav_group(value, title)) is not None:
                return found
    return None


def test_the_nav_lists_every_page_once():
    listed = _nav_pages(_nav())
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")
             if "runs" not in p.relative_to(ROOT / "docs").parts}
    assert sorted(set(listed)) == sorted(listed), "a page is listed twice"
    assert pages - set(listed) == set(), "add these pages to the nav of mkdocs.yml"
    assert set(listed) - pages <= {"configuration.md"}, "the nav lists pages that do not exist"


def test_archived_pages_open_by_naming_what_supersedes_them():
    """Every page of the Results > Archive nav group opens (after its provenance line) with a
    paragraph "**Archived.** ... superseded by [current page](...)"; a generated report in the
    group is covered by the archived page that links it."""
    import re

    archive = _nav_group(_nav_group(_nav(), "Results"), "Archive")
    assert archive, "mkdocs.yml: Results has an Archive group"
    archived = _nav_pages(archive)
    docs = ROOT / "docs"
    written = [p for p in archived if not p.endswith("/tables.md")]
    assert written
    linked = set()
    for rel in written:
        page = docs / rel
        paragraphs = _paragraphs_after_title(page.read_text())
        first = paragraphs[1] if paragraphs and paragraphs[0].startswith(">") else (paragraphs or [""])[0]
        assert first.startswith("**Archived.**"), f"{rel}: open with a paragraph '**Archived.** ...'"
        assert "superseded by" in first, f"{rel}: say what it is superseded by"
        targets = {(page.parent / t).resolve().relative_to(docs.resolve()).as_posix()
                   for t in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", first)}
        current = {t for t in targets if t not in archived and (docs / t).exists()}
        assert current, f"{rel}: link the current page that supersedes it in the first paragraph"
        linked |= {(page.parent / t).resolve().relative_to(docs.resolve()).as_posix()
                   for t in re.findall(r"\]\(([^)#\s]+/tables\.md)\)", page.read_text())}
    reports = [p for p in archived if p.endswith("/tables.md")]
    assert set(reports) <= linked, f"link each archived report from its archived page: {set(reports) - linked}"


def test_the_grid_example_of_the_benchmarks_page_names_the_folders_its_candidates_run_in():
    """docs/benchmarks.md's grid example, expanded by the bench: the folder the page names is a cell's."""
    import re

    import yaml

    from fedlt.bench.suite import Suite, expand, parse_suite

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text.split("### Choices made on validation data")[1]
    example = yaml.safe_load(section.split("```yaml")[1].split("```")[0])
    suite = Suite(parse_suite({"name": "example", **example}, "docs/benchmarks.md"), ROOT / "docs", None)
    folders = {c.run_dir.as_posix() for c in expand(suite, Path("OUT"), seeds=[0])}
    named = re.findall(r"`(OUT/[^`]+/seed0)`", section.split("```yaml")[0])
    assert named and set(named) <= folders, (named, sorted(folders))


def test_the_deployment_page_says_what_the_ledger_command_does():
    """It prints the table, and with a FILE writes the table alone over that file: the page is not regenerated."""
    page = " ".join((ROOT / "docs" / "deploying.md").read_text().split())
    assert "`python -m fedlt.docs_ledger` prints the table" in page
    assert "replacing the whole file with the table alone" in page
    assert "regenerates the table" not in page


def test_the_contributing_guide_names_every_module():
    """"How the package is laid out" names each module (a method's own module is one of "one module per method")."""
    from fedlt.methods.registry import METHODS

    guide = (ROOT / "CONTRIBUTING.md").read_text()
    package = ROOT / "src" / "fedlt"
    unnamed = [p.relative_to(package).as_posix() for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" and p.name not in guide
               and not (p.parent.name == "methods" and p.stem in METHODS)]
    assert unnamed == [], "describe these modules in CONTRIBUTING.md"
