"""What the fused kernels lack, refused or left to the eager blocks: Gemma-2's soft-capped scores."""

import numpy as np
import pytest

from attnlab import anatomy
from attnlab.attention import fused
from attnlab.extraction.extract import extract
from test_attention import TINY, _prompts
from test_kernels import _both_paths, kernel_calls  # noqa: F401 -- the fixture


def test_soft_capped_layers_stay_eager_and_a_config_forcing_the_kernels_is_refused(kernel_calls, monkeypatch,
                                                                                  caplog, tmp_path):
    """Gemma-2's soft-capped scores: no kernel launch, the eager blocks' numbers, the reason in the
    log; before any job, ATTNLAB_FUSED_ATTENTION=on is refused and auto said to stay eager."""
    from attnlab.config.checks import ConfigError
    from attnlab.config.validate import _check_kernels

    model = TINY["gemma2-softcap"]()
    prompts = _prompts([12, 8], inserted=(2, 6), vocab=101)
    with caplog.at_level("INFO", logger="attnlab.attention.fused"):
        eager, kernels = _both_paths(monkeypatch, lambda: extract(model, prompts, 2, []))
    assert kernel_calls == [] and "attention logit soft-capping" in caplog.text
    np.testing.assert_array_equal(eager.received[1], kernels.received[1])
    family = anatomy.of(model).family
    with pytest.raises(ConfigError, match="needs attention logit soft-capping, which the fused attention kernels lack"):
        _check_kernels("g2", family, ["extraction"])
    monkeypatch.setenv(fused.MODE_VARIABLE, "auto")
    with caplog.at_level("WARNING", logger="attnlab.config.validate"):
        _check_kernels("g2", family, ["extraction"])
    assert "run the eager attention blocks" in caplog.text
