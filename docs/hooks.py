"""mkdocs hooks (``hooks:`` in mkdocs.yml): the configuration reference is generated from the
pydantic schema at every build (:mod:`fedlt.docs_config`), so it cannot drift from the code."""

from __future__ import annotations

from mkdocs.structure.files import File, Files

from fedlt.docs_config import render


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "configuration.md", content=render()))
    return files
