"""Stage folders for readers and killed writers: a reader process never finds the stage missing or half-written while
a writer process rewrites it; a SIGKILLed writer leaves nothing visible and its leftovers go at the next write
(issue 27, item 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tinydata import kill_at_marker
from xc_dagster.storage import ArtifactStore, atomic_dir, file_lock, stage_leftovers, sweep_stage

REWRITES = 300
# the writer: rewrites data.txt in pieces (each flushed), so a half-written file would be visible if it were exposed
WRITER = """
import sys
from pathlib import Path
from xc_dagster.storage import atomic_dir
final, n = Path(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    with atomic_dir(final) as d:
        with open(d / "data.txt", "w") as f:
            f.write(f"v{i}\\n"); f.flush(); f.write("x" * 2000); f.flush(); f.write("\\nend\\n")
        (d / "second.txt").write_text(str(i))
"""
# the reader: reads the stage by its path in a loop until told to stop; counts whole, missing and partial reads
READER = """
import json, sys
from pathlib import Path
final, stop = Path(sys.argv[1]), Path(sys.argv[2])
counts, seen = {"whole": 0, "missing": 0, "partial": 0}, set()
print("reading", flush=True)
while not stop.exists():
    try:
        text = (final / "data.txt").read_text()
        is_dir = final.is_dir()
    except FileNotFoundError:
        counts["missing"] += 1
        continue
    whole = is_dir and text.startswith("v") and text.endswith("\\nend\\n") and len(text) > 2000
    counts["whole" if whole else "partial"] += 1
    seen.add(text.split("\\n", 1)[0])
counts["versions"] = len(seen)
print(json.dumps(counts), flush=True)
"""
# a writer that signals from inside the write (half of the folder written) and waits to be killed
KILLED = """
import sys, time
from pathlib import Path
from xc_dagster.storage import atomic_dir
with atomic_dir(Path(sys.argv[1])) as d:
    (d / "data.txt").write_text("half")
    print("inside", flush=True)
    time.sleep(600)
"""


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _write(final: Path, text: str) -> None:
    with atomic_dir(final) as d:
        (d / "data.txt").write_text(text)


def _kill_inside_a_write(final: Path) -> None:
    """A child process enters a write of ``final``, then is SIGKILLed there."""
    kill_at_marker(_child(KILLED, final), "inside")


def _visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_a_reader_never_sees_the_stage_missing_or_half_written_while_it_is_rewritten(tmp_path):
    final, stop = tmp_path / "data" / "stage", tmp_path / "stop"
    _write(final, "v-first\n" + "x" * 2000 + "\nend\n")
    reader = _child(READER, final, stop)
    try:
        assert reader.stdout.readline().strip() == "reading"
        writer = _child(WRITER, final, REWRITES)
        assert writer.wait(timeout=300) == 0
    finally:
        stop.touch()
    counts = json.loads(reader.communicate(timeout=60)[0])
    assert reader.returncode == 0
    assert counts["missing"] == 0 and counts["partial"] == 0, counts
    assert counts["versions"] >= 10  # the reads overlapped the rewrites: many versions seen
    assert (final / "data.txt").read_text().startswith(f"v{REWRITES - 1}\n")
    assert (final / "second.txt").read_text() == str(REWRITES - 1)
    assert _visible(final.parent) == ["stage"] and stage_leftovers(final) == []  # each replaced version removed


def test_a_writer_killed_mid_write_leaves_nothing_visible_and_the_next_write_sweeps_it(tmp_path):
    store = ArtifactStore(tmp_path)
    final = store.stage_dir("Data", "pretrain")
    _write(final, "old")
    _kill_inside_a_write(final)
    assert (store.require("Data", "pretrain") / "data.txt").read_text() == "old"  # the old version, whole
    assert _visible(final.parent) == ["pretrain"]
    left = stage_leftovers(final)
    assert len(left) == 1 and (left[0] / "data.txt").read_text() == "half"  # hidden, not yet removed
    with store.writing("Data", "pretrain") as out:
        (out / "data.txt").write_text("new")
    assert (final / "data.txt").read_text() == "new"
    assert stage_leftovers(final) == [] and not left[0].exists()


def test_a_first_write_killed_leaves_no_stage(tmp_path):
    final = tmp_path / "Data" / "index"
    _kill_inside_a_write(final)
    assert not final.exists() and _visible(final.parent) == []
    with pytest.raises(FileNotFoundError):
        ArtifactStore(tmp_path).require("Data", "index")
    assert len(stage_leftovers(final)) == 1
    assert len(sweep_stage(final)) == 1 and stage_leftovers(final) == []  # no writer alive: swept


def test_a_live_writers_folder_is_not_swept(tmp_path):
    """A write that starts while another is in progress leaves the other's version folder alone."""
    final = tmp_path / "Data" / "classifier"
    with atomic_dir(final) as slow:
        (slow / "data.txt").write_text("slow")
        with file_lock(final.parent / ".classifier.lock", blocking=False) as alone:
            assert not alone  # the writer in progress holds the lock shared
        assert sweep_stage(final) == []
        _write(final, "fast")
        assert (slow / "data.txt").read_text() == "slow"  # still there, mid-write
    assert (final / "data.txt").read_text() == "slow"  # the last to finish is published
    assert stage_leftovers(final) == []


def test_a_folder_of_the_earlier_layout_is_replaced_and_its_leftovers_swept(tmp_path):
    """A home written before versioned stages: a real stage folder, and the rename-away scheme's leftovers."""
    final = tmp_path / "Data" / "ingest"
    final.mkdir(parents=True)
    (final / "data.txt").write_text("legacy")
    for name in (".ingest.tmp-1a2b3c4d", ".ingest.old-5e6f7a8b"):
        (final.parent / name).mkdir()
        (final.parent / name / "big.npy").write_bytes(b"0" * 64)
    _write(final, "new")
    assert final.is_symlink() and (final / "data.txt").read_text() == "new"
    assert _visible(final.parent) == ["ingest"] and stage_leftovers(final) == []


def test_a_write_of_any_stage_sweeps_the_dataset(tmp_path):
    """A killed index write is reclaimed by the next write of another stage of the dataset, not only of the index."""
    store = ArtifactStore(tmp_path)
    _kill_inside_a_write(store.stage_dir("Data", "index"))
    (tmp_path / "Data" / ".pretrain.tmp-0123abcd").mkdir()  # the earlier scheme's leftover of another stage
    with store.writing("Data", "evaluate") as out:
        (out / "data.txt").write_text("metrics")
    assert _visible(tmp_path / "Data") == ["evaluate"]
    for stage in ("index", "pretrain", "evaluate"):
        assert stage_leftovers(store.stage_dir("Data", stage)) == [], stage
