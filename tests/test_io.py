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
