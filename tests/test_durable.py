"""A file replaced whole (``xc_dagster.durable.atomic_write``): the new content on success, the old one and no
temporary file when the write raises."""

from __future__ import annotations

import pytest

from xc_dagster.durable import atomic_write, atomic_write_text


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"old")
    atomic_write(path, lambda tmp: tmp.write_bytes(b"\x00new\xff"))
    assert path.read_bytes() == b"\x00new\xff"
    atomic_write_text(tmp_path / "sub" / "note.txt", "text")  # the folder is made
    assert (tmp_path / "sub" / "note.txt").read_text() == "text"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["data.bin", "note.txt", "sub"]


@pytest.mark.parametrize("fixed", [False, True])
def test_a_write_that_raises_leaves_the_file_untouched_and_no_temporary_file(tmp_path, fixed):
    path = tmp_path / "data.bin"
    path.write_bytes(b"old")
    tmp = tmp_path / ".data.bin.tmp" if fixed else None
    if fixed:
        tmp.write_bytes(b"a killed write's leftover")

    def write(to):
        to.write_bytes(b"half")
        raise KeyError("disk full")

    with pytest.raises(KeyError, match="disk full"):
        atomic_write(path, write, tmp=tmp)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["data.bin"]


def test_a_folder_written_under_a_fixed_name_is_removed_when_the_write_raises(tmp_path):
    def write(to):
        (to / "part").mkdir(parents=True)
        raise OSError("no space")

    with pytest.raises(OSError, match="no space"):
        atomic_write(tmp_path / "index", write, tmp=tmp_path / ".index.tmp")
    assert list(tmp_path.iterdir()) == []
