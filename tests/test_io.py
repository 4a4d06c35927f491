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
