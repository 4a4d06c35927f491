"""The kept-gap flag (``circuits.task_gap``): a copy is flagged as having lost a task by its point
estimate of the kept gap against ``KEPT_GAP_FLOOR`` (0.8), as docs/patching.md says
("``task_lost`` (kept_gap < ``task_gap.KEPT_GAP_FLOOR``, 0.8)"), whatever its interval spans."""

import pytest

from attnlab.circuits.counting import Bootstrap
from attnlab.circuits.task_gap import KEPT_GAP_FLOOR, kept_gap, kept_gap_text


def _sweep(gaps: list[float]) -> dict:
    """A sweep.json's per-prompt metrics whose clean − corrupted gaps are ``gaps``."""
    return {"clean_metric_per_prompt": [1.0 + gap for gap in gaps], "corrupted_metric_per_prompt": [1.0] * len(gaps),
            "counted_prompts_digest": "same prompts"}


@pytest.mark.parametrize("copy_gaps, point, lost", [
    ([0.35, 1.15] * 4, 0.75, True),  # below 0.8, its interval reaching above it
    ([0.45, 1.25] * 4, 0.85, False),  # above 0.8, its interval reaching below it
])
def test_the_task_lost_flag_follows_the_point_estimate_when_the_interval_straddles_the_floor(copy_gaps, point, lost):
    """The base's gap is 1 on each of 8 prompts, so the kept gap is the copy's mean gap, by hand
    0.75 or 0.85; the copy's gaps alternate 0.8 apart, so resamples of 8 prompts spread its
    interval across 0.8. Judging the interval's far end (all of it below the floor) or its near
    end (any of it below) would flip one of the two cases."""
    assert KEPT_GAP_FLOOR == 0.8
    gap = kept_gap(_sweep([1.0] * 8), _sweep(copy_gaps), Bootstrap(1000, 0.95, 0))
    assert gap["kept_gap"] == pytest.approx(point) and gap["kept_gap_paired"]
    assert gap["kept_gap_low"] < 0.8 < gap["kept_gap_high"]  # the case this test is about
    assert gap["task_lost"] is lost
    text = kept_gap_text("copy", "dense", gap)
    flag = " (< 80%: the task is lost)" if lost else ""
    assert text.startswith(f"copy keeps {point:.0%} [") and text.endswith(f"of dense's clean−corrupted gap{flag}")
