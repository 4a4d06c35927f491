import pytest

from attnlab.io import atomic_path


def test_atomic_file_appears_only_on_success(tmp_path):
    target = tmp_path / "out" / "table.csv"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert not target.exists()
    assert list(target.parent.iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole"


def test_atomic_directory_replaces_old(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "old").write_text("x")
    with atomic_path(target, directory=True) as tmp:
        (tmp / "new").write_text("y")
    assert [p.name for p in target.iterdir()] == ["new"]


def test_successful_write_sweeps_leftovers_of_killed_writers(tmp_path):
    target = tmp_path / "cell.h5"
    (tmp_path / ".cell.h5.tmp-abc.h5").write_text("partial")
    (tmp_path / ".cell.h5.tmp-dir").mkdir()
    (tmp_path / ".other.h5.tmp-xyz.h5").write_text("someone else's")
    with atomic_path(target) as tmp:
        tmp.write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.h5.tmp-xyz.h5", "cell.h5"]


@pytest.mark.parametrize("suffix", ["parquet", "h5"])
def test_truncated_input_names_the_file_and_the_rerun(tmp_path, suffix):
    import h5py
    import numpy as np
    import pandas as pd

    from attnlab.io import UnreadableFileError, open_hdf5, read_parquet

    path = tmp_path / f"cell.{suffix}"
    if suffix == "parquet":
        pd.DataFrame({"x": np.arange(5000)}).to_parquet(path)
    else:
        with h5py.File(path, "w") as h5:
            h5["x"] = np.arange(5000)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a copy cut short
    read = read_parquet if suffix == "parquet" else open_hdf5
    with pytest.raises(UnreadableFileError, match=rf"{path} cannot be read .* truncated or corrupt\. "
                                                  rf"Rerun the job that writes it with `snakemake -R {path}`"):
        read(path)
    with pytest.raises(FileNotFoundError):
        read(tmp_path / f"missing.{suffix}")
