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
COMMON_ABBREVIATIONS = {"AES-256", "AI", "API", "CA", "CI", "CLI", "CONTRIBUTING", "CPU", "CSV", "CTR", "CUDA", "DNS",
                        "EC", "ECDH", "ETA", "GPU", "H100", "HKDF", "II", "IP", "JSON", "NIST", "NOT", "PIL", "PORT",
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
