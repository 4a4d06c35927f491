"""Every report caption (workflow/report/*.rst) renders as Snakemake renders it (Jinja, then
docutils' HTML writer) without a docutils system message (warning or error: a red box inside the
caption of the built report), and says something. The tiny run's built report is checked for the
same in tests/test_workflow_faults.py; this covers the captions that run never shows (edge
circuits, sparse post-training)."""

import io
from pathlib import Path
from types import SimpleNamespace

import jinja2
import pytest
import yaml
from docutils.core import publish_parts

from attnlab.config.schema import validate_config

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = sorted((REPO / "workflow" / "report").glob("*.rst"))


class _Anything(jinja2.ChainableUndefined):
    """Any wildcard, parameter or input a caption reads: a word, or a list of words where iterated."""

    def __str__(self):
        return "name"

    def __iter__(self):
        return iter(["first", "second"])


def render(path: Path) -> tuple[str, str]:
    """(the caption's HTML body, docutils' messages) for the default config."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate_config(config, REPO / "config" / "schema.yaml")
    snakemake = SimpleNamespace(config=config, wildcards=_Anything(), params=_Anything(), input=_Anything(),
                                output=_Anything())
    text = jinja2.Environment(undefined=_Anything).from_string(path.read_text()).render(
        snakemake=snakemake, categories=_Anything(), files=_Anything())
    messages = io.StringIO()
    body = publish_parts(text, writer_name="html",
                         settings_overrides={"warning_stream": messages, "report_level": 2})["body"]
    return body, messages.getvalue()


@pytest.mark.parametrize("path", CAPTIONS, ids=lambda path: path.name)
def test_each_caption_renders_without_a_docutils_message(path):
    body, messages = render(path)
    assert messages == "" and "system-message" not in body, messages or body
    assert len(body.strip()) > 80, body  # it says something


def test_the_check_sees_a_substitution_reference(tmp_path):
    """What made the edge captions fail: ``|score|`` is a reStructuredText substitution."""
    broken = tmp_path / "broken.rst"
    broken.write_text("Edges of largest |score| are kept, and more words to make it a caption.\n")
    body, messages = render(broken)
    assert 'Undefined substitution referenced: "score"' in messages and "system-message" in body
