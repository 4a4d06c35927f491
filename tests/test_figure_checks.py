"""The check every figure the tests draw goes through (``attnlab.plots.base.text_collisions``, enforced
by ATTNLAB_STRICT_FIGURES): it reports text drawn over other text and text off the canvas, and
strict saving refuses such a figure."""

import logging

import pytest

from attnlab.plots.base import _save, plt, text_collisions


def _figure(overlapping: bool, off_canvas: bool):
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1])
    ax.text(0.3, 0.5, "first label", transform=ax.transAxes)
    if overlapping:
        ax.text(0.35, 0.5, "second label", transform=ax.transAxes)  # over the first
    else:
        ax.text(0.3, 0.2, "second label", transform=ax.transAxes)  # well below it
    if off_canvas:
        fig.text(0.9, 0.5, "a label running off the right edge")
    return fig


def test_overlapping_text_and_text_off_the_canvas_are_both_reported():
    clean = _figure(overlapping=False, off_canvas=False)
    assert text_collisions(clean) == []
    plt.close(clean)
    fig = _figure(overlapping=True, off_canvas=True)
    problems = text_collisions(fig)
    plt.close(fig)
    assert "'first label' overlaps 'second label'" in problems
    assert "'a label running off the right edge' outside the canvas" in problems
    assert len(problems) == 2, problems


def test_strict_saving_refuses_a_colliding_figure_and_writes_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ATTNLAB_STRICT_FIGURES", "1")
    with pytest.raises(RuntimeError, match=r"f\.png: text collides or is cut off: 'first label' overlaps "
                                           r"'second label'"):
        _save(_figure(overlapping=True, off_canvas=False), tmp_path / "f.png", 50)
    assert not (tmp_path / "f.png").exists()
    with pytest.raises(RuntimeError, match="outside the canvas"):
        _save(_figure(overlapping=False, off_canvas=True), tmp_path / "g.png", 50)
    # without the strict setting (a workflow run): written, the problem named in the log
    monkeypatch.delenv("ATTNLAB_STRICT_FIGURES")
    with caplog.at_level(logging.WARNING):
        _save(_figure(overlapping=True, off_canvas=False), tmp_path / "h.png", 50)
    assert (tmp_path / "h.png").stat().st_size > 0 and "'first label' overlaps 'second label'" in caplog.text
