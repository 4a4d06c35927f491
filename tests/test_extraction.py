import h5py
import numpy as np
import pytest

from attnlab.config.checks import HeadRangeError
from attnlab.extraction.analysis import align, mean_and_band, read_head
from attnlab.extraction.extract import extract, write_attention
from attnlab.extraction.h5format import IncompleteFileError, open_attention
from test_attention import TINY, _prompts


@pytest.fixture()
def written(tmp_path):
    model = TINY["llama-gqa"]()
    prompts = _prompts([12, 8, 15], inserted=(2, 6), vocab=101)
    for region, (start, end) in {"system": (0, 2), "question": (6, None), "cut": (2, 6)}.items():
        prompts[f"{region}_start"], prompts[f"{region}_end"] = start, end or prompts["n_prompt_tokens"]
    path = tmp_path / "cell.h5"
    write_attention(path, extract(model, prompts, 2, []), prompts, {"model": "tiny", "condition": "c"})
    return path, prompts


def test_written_file_reads_back(written):
    path, prompts = written
    head = read_head(path, layer=2, head=3)
    assert head["values"].shape == (3, 15)
    assert head["ids"].tolist() == ["p0", "p1", "p2"]
    assert np.isnan(head["values"][1, 8:]).all()


def test_every_array_reads_back_as_written_maps_included(tmp_path):
    """Received attention, λ and full maps (the configured map layers) come back value for value
    through the readers, each prompt left-aligned and NaN past its length; the maps equal eager
    attention computed by transformers, one prompt at a time."""
    from test_attention import _reference

    model = TINY["qwen2"]()
    prompts = _prompts([12, 8, 15], inserted=(2, 6), vocab=101)
    for region, (start, end) in {"system": (0, 2), "question": (6, None), "cut": (2, 6)}.items():
        prompts[f"{region}_start"], prompts[f"{region}_end"] = start, end or prompts["n_prompt_tokens"]
    extraction = extract(model, prompts, 2, [1])
    path = tmp_path / "cell.h5"
    write_attention(path, extraction, prompts, {"model": "tiny", "condition": "c"})
    eager = _reference(model, prompts)  # per prompt, per layer: (received, λ, maps), unpadded
    with open_attention(path) as h5:
        assert sorted(h5["maps"]) == ["layer_01"]
        maps = h5["maps/layer_01"][:]
        assert maps.dtype == np.float16 and maps.shape == (4, 3, 15, 15)
        for p, length in enumerate(prompts["n_prompt_tokens"]):
            np.testing.assert_allclose(maps[:, p, :length, :length], eager[p][1][2], atol=1e-3)
            assert np.isnan(maps[:, p, length:]).all() and np.isnan(maps[:, p, :, length:]).all()
    for layer in range(3):
        for name, index in (("received", 0), ("lam", 1)):
            for h in range(4):
                values = read_head(path, layer, h, name)["values"]
                for p, length in enumerate(prompts["n_prompt_tokens"]):
                    np.testing.assert_array_equal(values[p, :length], extraction.__dict__[name][layer][h, p, :length])
                    np.testing.assert_allclose(values[p, :length], eager[p][layer][index][h], atol=1e-5)


def test_out_of_range_head_names_the_model_shape(written):
    path, _ = written
    with pytest.raises(HeadRangeError, match=r"model 'tiny' has 3 layers x 4 heads"):
        read_head(path, layer=3, head=0)


def test_incomplete_file_is_refused(written):
    path, _ = written
    with h5py.File(path, "a") as h5:
        h5.attrs["complete"] = False
    with pytest.raises(IncompleteFileError, match="delete it and rerun"):
        open_attention(path)


def test_killed_write_leaves_no_file(tmp_path, written, monkeypatch):
    _, prompts = written
    import attnlab.extraction.extract as extraction

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # stands in for a kill arriving mid-write

    monkeypatch.setattr(extraction, "_versions", crash)
    target = tmp_path / "killed.h5"
    with pytest.raises(KeyboardInterrupt):
        write_attention(target, extract(TINY["llama-gqa"](), prompts, 2, []), prompts, {})
    assert not target.exists() and not list(tmp_path.glob(".killed.h5.tmp-*"))


def test_align_removes_the_inserted_run():
    values = np.arange(20, dtype=np.float32).reshape(2, 10)
    spans = np.array([[[0, 2], [2, 4], [5, 10], [2, 5]], [[0, 2], [2, 4], [5, 8], [2, 5]]])
    aligned = align(values, spans, np.array([10, 8]), remove_inserted=True)
    assert aligned[0].tolist() == [0, 1, 5, 6, 7, 8, 9]
    assert aligned[1, :5].tolist() == [10, 11, 15, 16, 17] and np.isnan(aligned[1, 5:]).all()
    mean, low, high = mean_and_band(aligned, min_share=1.0)
    assert len(mean) == 5 and mean[0] == 5.0 and low[0] < 5.0 < high[0]


def test_full_map_layer_out_of_range_is_named():
    prompts = _prompts([6], inserted=None, vocab=101)
    with pytest.raises(HeadRangeError, match=r"full_map_layers \[3\]: the model has 3 layers"):
        extract(TINY["llama-gqa"](), prompts, 1, [3])


def test_removing_the_insertion_recovers_the_plain_prompt(smollm2_tokenizer):
    """Cutting the inserted run (and its separator) leaves exactly the tokens of `none`."""
    from attnlab.reasoning.prompts import SPANS, make_prompts
    import pandas as pd

    questions = pd.DataFrame({"id": ["a"], "question": ["What is 7 + 5?"], "answer": ["12"]})
    cfg = {"system": "Be brief.", "raw_template": "{system}\n{user}\nSolution:"}
    for fmt in ("chat", "raw"):
        plain = make_prompts(smollm2_tokenizer, questions, "none", {"kind": "none"}, cfg, fmt, 999)
        mless = make_prompts(smollm2_tokenizer, questions, "mless",
                             {"kind": "repeat", "unit": "/", "length": 9}, cfg, fmt, 999)
        ids = np.asarray(mless["input_ids"][0], dtype=np.float32)[None]
        spans = mless[[f"{r}_{e}" for r in SPANS for e in ("start", "end")]].to_numpy().reshape(1, 4, 2)
        kept = align(ids, spans, np.array([len(ids[0])]), remove_inserted=True)[0]
        assert kept.tolist() == list(plain["input_ids"][0]), fmt


def test_band_is_a_seeded_percentile_bootstrap_per_position():
    """Positions held by 4, 3 and 1 prompts: each band is grading.bootstrap_ci over the prompts
    present there (the accuracy figures' interval, same seed), no width for one prompt."""
    from attnlab.extraction.analysis import BAND_RESAMPLES, BAND_SEED
    from attnlab.reasoning.grading import bootstrap_ci

    aligned = np.array([[1.0, 2.0, 5.0], [2.0, 4.0, np.nan], [4.0, 3.0, np.nan], [3.0, np.nan, np.nan]])
    mean, low, high = mean_and_band(aligned, min_share=0.0)
    np.testing.assert_allclose(mean, [2.5, 3.0, 5.0])
    assert (low[0], high[0]) == bootstrap_ci([1, 2, 4, 3], 0.95, BAND_RESAMPLES, BAND_SEED)
    assert (low[1], high[1]) == bootstrap_ci([2, 4, 3], 0.95, BAND_RESAMPLES, BAND_SEED)
    assert low[2] == high[2] == 5.0
    again = mean_and_band(aligned, min_share=0.0)
    np.testing.assert_array_equal(np.r_[low, high], np.r_[again[1], again[2]])


def test_band_of_a_share_stays_inside_0_and_1():
    """Six prompts, mostly near 0 and one at 0.3 (attention received, a quantity in [0, 1]): a
    normal interval goes below 0 there; the bootstrap band stays inside [0, 1]."""
    aligned = np.array([[0.0, 0.95], [0.0, 1.0], [0.01, 1.0], [0.0, 0.9], [0.0, 1.0], [0.3, 1.0]])
    mean, low, high = mean_and_band(aligned)
    normal_low = aligned.mean(0) - 1.96 * aligned.std(0, ddof=1) / np.sqrt(len(aligned))
    normal_high = aligned.mean(0) + 1.96 * aligned.std(0, ddof=1) / np.sqrt(len(aligned))
    assert normal_low[0] < 0 and normal_high[1] > 1  # what the band must not do
    assert (low >= 0).all() and (high <= 1).all()
    assert (low <= mean).all() and (mean <= high).all() and low[0] < high[0]


def test_hdf5_names_the_tokenizer_and_its_hash(tmp_path):
    """Not the class name (the same for every model): where it came from and a hash of tokenizer.json."""
    import hashlib

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from attnlab import steps

    model_dir = tmp_path / "tiny-model"
    TINY["llama-gqa"]().save_pretrained(model_dir)
    vocab = {f"w{i}": i for i in range(101)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0"))).save_pretrained(model_dir)
    prompts = _prompts([6, 9], inserted=(1, 3), vocab=101)
    prompts.to_parquet(tmp_path / "prompts.parquet")
    settings = {"max_prompts": None, "device": "cpu", "dtype": "float32", "batch_size": 2, "full_map_layers": []}
    out = tmp_path / "cell.h5"
    steps.extract_attention(str(model_dir), str(tmp_path / "prompts.parquet"), str(out), settings,
                            {"model": "tiny", "condition": "c"}, threads=1)
    with h5py.File(out) as h5:
        assert h5.attrs["tokenizer"] == str(model_dir)
        assert h5.attrs["tokenizer_sha256"] == hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()
        assert h5.attrs["tokenizer_class"] != ""
