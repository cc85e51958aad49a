"""Hostile input at ingest: lying headers, decompression bombs, endless lines and lying ``.npy`` headers fail
with a clear XCFormatError naming the file, in bounded memory, and leave nothing half-written in the cache.

The readers run in a child process under ``RLIMIT_AS`` (1.5 GiB of address space): before these limits existed
each case exhausted it (MemoryError) or filled the cache.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from xc_dagster.catalog import Catalog
from xc_dagster.cli import checked_source
from xc_dagster.cli import main as cli_main
from xc_dagster.data import read_dataset, resolve_source
from xc_dagster.data.accumulators import Growing
from xc_dagster.data.clicklog_reader import read_click_log
from xc_dagster.errors import XCConfigError, XCFormatError
from xc_dagster.home import Home

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
AS_LIMIT = 3 * (1 << 29)  # 1.5 GiB of address space for the child

CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
from pathlib import Path
from xc_dagster.data import read_dataset, resolve_source
from xc_dagster.errors import XCFormatError
out = []
for job in json.loads(sys.argv[2]):
    try:
        src = Path(job["source"])
        read_dataset(resolve_source(str(src), Path(job["cache"])) if job.get("cache") else src)
        out.append({"error": None})
    except XCFormatError as e:
        out.append({"error": "XCFormatError", "message": str(e)})
    except MemoryError as e:
        out.append({"error": "MemoryError", "message": repr(e)})
# this process's peak RSS (ru_maxrss would start from the parent's at the fork)
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"results": out, "maxrss_mib": int(hwm) / 1024}))
"""


def run_child(jobs: list[dict]) -> tuple[list[dict], float]:
    """Each job (``source``, optional ``cache``) read by ``read_dataset`` in one child under ``RLIMIT_AS``."""
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_AS and /proc/self/status as Linux has them")
    # Arrow's default allocator (mimalloc) reserves about 1 GiB of address space up front, which RLIMIT_AS
    # counts although none of it is used: the system allocator makes the limit measure what is allocated
    env = {k: v for k, v in os.environ.items() if not k.startswith("XC_INGEST_")}  # the default limits
    env.update({"OMP_NUM_THREADS": "1", "ARROW_DEFAULT_MEMORY_POOL": "system", "PYTHONPATH": str(REPO)})
    proc = subprocess.run([sys.executable, "-c", CHILD, str(AS_LIMIT), json.dumps(jobs)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]  # not killed, no uncaught error
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report["results"], report["maxrss_mib"]


def assert_clear(result: dict, *needles: str) -> None:
    assert result["error"] == "XCFormatError", result
    for needle in needles:
        assert needle in result["message"], result["message"]


def gz_repeated(block: bytes, times: int) -> bytes:
    """``block`` repeated ``times`` times as a multi-member gzip stream (compressed once: fast to make)."""
    member = gzip.compress(block, compresslevel=9)
    return member * times


def split_sparse(folder: Path, trn: str, tst: str = "1 3\n0:1\n", **extra: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "trn_X_Y.txt").write_text(trn)
    (folder / "tst_X_Y.txt").write_text(tst)
    for name, text in extra.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


def no_cache_leftovers(cache: Path) -> None:
    assert not cache.exists() or sorted(p.name for p in cache.iterdir()) == [], list(cache.iterdir())


# ------------------------------------------------------------------------------------------ lying headers

def test_lying_headers_fail_clearly_in_bounded_memory(tmp_path):
    """Header counts a tiny file cannot back (10^12 labels; 2*10^9 labels with one id used; 2*10^9 rows; a BoW
    ``L`` of 2*10^9) never size an allocation: each raises naming the file, line 1 and the field."""
    texts = {"trn_X__txt": "a\n", "tst_X__txt": "b\n"}
    cases = {
        "labels_1e12": split_sparse(tmp_path / "a", "1 1000000000000\n0:1\n", "1 1000000000000\n2:1\n", **texts),
        "labels_2e9": split_sparse(tmp_path / "b", "1 2000000000\n1999999999:1\n",
                                   "1 2000000000\n5:1\n", **texts),
        "rows_2e9": split_sparse(tmp_path / "c", "2000000000 3\n0:1\n", **texts),
    }
    bow = tmp_path / "bow"
    bow.mkdir()
    (bow / "toy_train.txt").write_text("1 5 2000000000\n0 1:1\n")
    (bow / "toy_test.txt").write_text("1 5 2000000000\n1 2:1\n")
    cases["bow_L_2e9"] = bow
    assert os.path.getsize(cases["labels_1e12"] / "trn_X_Y.txt") < 40
    results, rss = run_child([{"source": str(p)} for p in cases.values()])
    got = dict(zip(cases, results))
    assert_clear(got["labels_1e12"], "trn_X_Y.txt:1", "'cols' at most 2,147,483,647")
    assert_clear(got["labels_2e9"], "trn_X_Y.txt:1", "'cols' at most 1,048,576 more than the distinct columns")
    assert_clear(got["rows_2e9"], "trn_X_Y.txt:1", "'rows' at most the 4 bytes after the header")
    assert_clear(got["bow_L_2e9"], "toy_train.txt:1", "'L' at most 1,048,576 more")
    assert rss < 768  # MiB; about 90 of it is the imports


def test_column_ids_past_2_31_do_not_wrap(tmp_path):
    """An accumulator of more than 2**31 - 1 columns keeps its ids (int64), never wraps them negative."""
    acc = Growing(tmp_path / "x", 3_000_000_000, "label")
    acc.append(np.array([2]), np.array([1, 2_999_999_999]), np.array([1.0, 1.0]))
    assert acc.to_csr().indices.tolist() == [1, 2_999_999_999]


def test_a_lying_npy_header_names_the_file(tmp_path):
    """A token array whose header claims 10^11 rows: XCFormatError naming the .npy, not a raw MemoryError."""
    folder = split_sparse(tmp_path / "tok", "2 3\n0:1\n1:1\n", "1 3\n2:1\n")
    with open(folder / "trn_doc_input_ids.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (10**11, 8)})
        f.write(b"\0" * 128)
    np.save(folder / "trn_doc_attention_mask.npy", np.ones((2, 8), np.int64))
    for name in ("tst_doc_input_ids.npy", "tst_doc_attention_mask.npy"):
        np.save(folder / name, np.ones((1, 8), np.int64))
    (result,), _ = run_child([{"source": str(folder)}])
    assert_clear(result, "trn_doc_input_ids.npy", "whose header's shape the file holds")


# ------------------------------------------------------------------------------------ decompression bombs

def _tar_member(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=tarfile.GNU_FORMAT)


def _tar_gz_one_line(path: Path, folder: str, head: bytes, n: int) -> Path:
    """A split-sparse .tar.gz whose ``trn_X_Y.txt`` is ``head`` then ``n`` bytes of '1' (one line), built from
    repeated gzip members so that a 300 MB member takes a few hundred KB and milliseconds."""
    tst = b"1 5\n0:1\n".ljust(tarfile.BLOCKSIZE, b"\0")
    size = len(head) + n
    pad = (-size) % tarfile.BLOCKSIZE
    parts = [gzip.compress(_tar_member(f"{folder}/tst_X_Y.txt", 8) + tst
                           + _tar_member(f"{folder}/trn_X_Y.txt", size) + head),
             gz_repeated(b"1" * MIB, n // MIB),
             gzip.compress(b"1" * (n % MIB) + b"\0" * (pad + 2 * tarfile.BLOCKSIZE))]
    path.write_bytes(b"".join(parts))
    return path


def test_decompression_bombs_are_refused_and_leave_nothing_in_the_cache(tmp_path):
    """A 200 KB .gz of 200 MB, a 300 KB .tar.gz of one 300 MB line and a .zip of 200 MB stop at the expansion
    cap: a clear error naming the archive, bounded memory, an empty cache (nothing half-written, nothing kept)."""
    gz = tmp_path / "trn_X_Y.txt.gz"
    gz.write_bytes(gz_repeated(b"0" * MIB, 200))
    tgz = _tar_gz_one_line(tmp_path / "line.tar.gz", "ds", b"2 5\n0:1 ", 300 * MIB)
    zp = tmp_path / "ds.zip"
    with zipfile.ZipFile(zp, "w", zipfile.ZIP_DEFLATED) as zf, zf.open("ds/trn_X_Y.txt", "w") as f:
        for _ in range(200):
            f.write(b"0" * MIB)
    assert gz.stat().st_size < 300_000 and tgz.stat().st_size < 400_000 and zp.stat().st_size < 400_000
    cache = tmp_path / "cache"
    results, rss = run_child([{"source": str(p), "cache": str(cache)} for p in (gz, tgz, zp)])
    for result, name in zip(results, ("trn_X_Y.txt.gz", "line.tar.gz", "ds.zip")):
        assert_clear(result, name, "compressed input that unpacks to at most 67,108,864 bytes")
    assert rss < 768  # MiB; about 90 of it is the imports
    no_cache_leftovers(cache)


def test_streamed_json_gz_bombs_fail_clearly_in_bounded_memory(tmp_path):
    """LF ``trn.json.gz`` files are read in place: one 300 MB line stops at the line limit; 400 MB of short
    lines from 1.2 MB stops at the expansion cap; both name the file."""
    folders = []
    for name, trn in (("line", gzip.compress(b'{"uid":"0","title":"') + gz_repeated(b"a" * MIB, 300)
                       + gzip.compress(b'","target_ind":[0]}\n')),
                      ("many", gz_repeated(b'{"uid":"0","title":"a","target_ind":[0]}\n' * 25_000, 400))):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "trn.json.gz").write_bytes(trn)
        (folder / "tst.json.gz").write_bytes(gzip.compress(b'{"uid":"1","title":"b","target_ind":[0]}\n'))
        (folder / "lbl.json.gz").write_bytes(gzip.compress(b'{"uid":"L","title":"l"}\n'))
        folders.append(folder)
    (line, many), rss = run_child([{"source": str(f)} for f in folders])
    assert_clear(line, "trn.json.gz:1", "lines of at most 33,554,432 bytes")
    assert_clear(many, "trn.json.gz", "unpacks to at most")
    assert rss < 768  # MiB; about 90 of it is the imports


def test_line_limit_names_file_and_line(tmp_path, monkeypatch):
    """``XC_INGEST_MAX_LINE_BYTES`` bounds every line read; the error names the file and the line."""
    folder = split_sparse(tmp_path / "ds", "3 9\n0:1\n1:1\n" + " ".join(["2:1"] * 400) + "\n", "1 9\n0:1\n",
                          trn_X__txt="a\nb\nc\n", tst_X__txt="d\n")
    monkeypatch.setenv("XC_INGEST_MAX_LINE_BYTES", "1000")
    with pytest.raises(XCFormatError, match=r"trn_X_Y\.txt:4: expected lines of at most 1,000 bytes"):
        read_dataset(folder)
    monkeypatch.delenv("XC_INGEST_MAX_LINE_BYTES")
    assert read_dataset(folder).num_train == 3


def test_killed_extraction_is_swept_by_the_next_install(tmp_path):
    """A process SIGKILLed while extracting into the cache leaves a temp folder; the next install of the same
    source removes it and installs a complete entry."""
    src = tmp_path / "src" / "ds"
    split_sparse(src, "2 3\n0:1\n1:1\n", trn_X__txt="a\nb\n", tst_X__txt="c\n")
    arc = tmp_path / "ds.tar.gz"
    with tarfile.open(arc, "w:gz") as tf:
        tf.add(src, arcname="ds")
    cache = tmp_path / "cache"
    hang = ("import sys, tarfile, time\n"
            "from pathlib import Path\n"
            "from xc_dagster.data import resolve_source\n"
            "def stuck(src, dst, length=None, *a, **k):\n"
            "    dst.write(b'partial'); dst.flush(); print('writing', flush=True); time.sleep(600)\n"
            "tarfile.copyfileobj = stuck\n"
            "resolve_source(sys.argv[1], Path(sys.argv[2]))\n")
    proc = subprocess.Popen([sys.executable, "-c", hang, str(arc), str(cache)], cwd=REPO, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"  # the child is inside a member's write
    finally:
        proc.kill()
        proc.wait()
    assert [p for p in cache.iterdir() if ".tmp-" in p.name]  # what the kill left
    got = resolve_source(str(arc), cache)
    assert read_dataset(got).num_train == 2
    assert [p.name for p in cache.iterdir()] == [got.parent.name]


# ------------------------------------------------------------------------ tar extraction on older Pythons

def test_tar_extraction_without_the_data_filter(tmp_path, monkeypatch):
    """Pythons before 3.10.12 / 3.11.4 have no ``tarfile.data_filter`` (and ``extractall`` takes no
    ``filter``): archives still extract, members that escape are refused, and symlinks are refused."""
    real_extractall = tarfile.TarFile.extractall

    def old_extractall(self, path=".", members=None, *, numeric_owner=False, **kw):
        if kw:
            raise TypeError(f"extractall() got an unexpected keyword argument {next(iter(kw))!r}")
        return real_extractall(self, path, members, numeric_owner=numeric_owner)

    monkeypatch.delattr(tarfile, "data_filter")
    monkeypatch.delattr(tarfile, "FilterError")
    monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
    src = split_sparse(tmp_path / "src" / "ds", "2 3\n0:1\n1:1\n", trn_X__txt="a\nb\n", tst_X__txt="c\n")
    good = tmp_path / "good.tar.gz"
    with tarfile.open(good, "w:gz") as tf:
        tf.add(src, arcname="ds")
        link = tarfile.TarInfo("ds/again.txt")
        link.type, link.linkname = tarfile.LNKTYPE, "ds/trn_X.txt"
        tf.addfile(link)
    got = resolve_source(str(good), tmp_path / "cache")
    assert read_dataset(got).train_texts == ["a", "b"] and (got / "again.txt").read_text() == "a\nb\n"
    for name, member in (("up.tar.gz", tarfile.TarInfo("../evil")), ("sym.tar.gz", tarfile.TarInfo("ds/l"))):
        if name == "sym.tar.gz":
            member.type, member.linkname = tarfile.SYMTYPE, "trn_X.txt"
        with tarfile.open(tmp_path / name, "w:gz") as tf:
            tf.addfile(member, io.BytesIO(b"") if member.isfile() else None)
        with pytest.raises(XCFormatError) as ei:
            resolve_source(str(tmp_path / name), tmp_path / "cache2")
        assert member.name in str(ei.value)
    no_cache_leftovers(tmp_path / "cache2")
    assert not (tmp_path / "evil").exists()



# --------------------------------------------------------------------------------------- smaller refusals

def test_datasets_add_stores_an_absolute_existing_source(tmp_path, monkeypatch, capsys):
    """A relative ``--source`` is stored absolute; a missing local path or ``file://`` is refused (nothing
    added); URLs and ``builtin:`` sources are stored as given."""
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    (tmp_path / "ds").mkdir()
    monkeypatch.chdir(tmp_path)
    assert cli_main(["datasets", "add", "Rel", "--source", "ds"]) == 0
    cat = Catalog(Home.from_env().catalog)
    assert cat.get("Rel").source == str(tmp_path / "ds")
    capsys.readouterr()
    assert cli_main(["datasets", "add", "Gone", "--source", "missing/ds"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and str(tmp_path / "missing" / "ds") in err
    assert cli_main(["datasets", "add", "GoneUrl", "--source", "file:///no/such/xc/folder"]) == 2
    assert "does not exist" in capsys.readouterr().err
    for name, src in (("Web", "https://example.com/ds.zip"), ("Emb", "builtin:LF-WordNetNouns"),
                      ("Bucket", "s3://bucket/ds")):
        assert cli_main(["datasets", "add", name, "--source", src]) == 0
        assert cat.get(name).source == src
    assert sorted(cat.load()) == ["Bucket", "Emb", "Rel", "Web"]


@pytest.mark.parametrize("source", ["", "   "])
def test_an_empty_source_is_refused_not_taken_for_the_current_directory(source):
    with pytest.raises(XCConfigError, match=f"^--source {source!r}: expected a dataset source .* got an empty value"):
        checked_source(source)


TEXTS = {"trn_X__txt": "a\nb\n", "tst_X__txt": "c\n"}


@pytest.mark.parametrize("trn, extra, expected", [
    ("2 0\n\n\n", TEXTS, "at least one label (split-sparse layout)"),
    ("2 3\n\n\n", TEXTS, "at least one label of a training point"),
    ("2 3\n0:1\n1:1\n", {"trn_X_Xf__txt": "2 4\n\n\n", **TEXTS}, "at least one non-zero feature"),
    ("2 3\n0:1\n1:1\n", {"trn_X_Xf__txt": "2 4\n0:0\n3:0\n", **TEXTS}, "at least one non-zero feature"),
    ("2 3\n0:1\n1:1\n", {}, "point texts, features or token arrays"),
])
def test_a_dataset_with_nothing_to_learn_is_refused_at_ingest(tmp_path, trn, extra, expected):
    """No labels, an all-zero label or feature matrix, or no point input at all: refused by ingest's reader
    (naming the folder), not left to fail stages later."""
    folder = split_sparse(tmp_path / "ds", trn, f"1 {trn.split()[1]}\n\n", **extra)
    with pytest.raises(XCFormatError, match=r"ds: expected " + expected.replace("(", r"\(").replace(")", r"\)")):
        read_dataset(folder)


def test_label_values_are_relevances_a_zero_is_none_a_negative_is_refused(tmp_path):
    """trn_X_Y.txt values: a 0 (given, or below float32's smallest) is no label -- no trainer then reads a stored 0
    as a positive -- and a negative value is refused naming the file, line and data row, even where repeats sum past
    0."""
    folder = split_sparse(tmp_path / "z", "2 3\n0:1 2:0\n1:0 2:1e-50\n", "1 3\n0:0 1:1\n", **TEXTS)
    ds = read_dataset(folder)
    assert ds.Y_train.nnz == 1 and ds.Y_train.toarray().tolist() == [[1, 0, 0], [0, 0, 0]]
    assert ds.Y_test.toarray().tolist() == [[0, 1, 0]] and ds.Y_test.nnz == 1
    bad = split_sparse(tmp_path / "n", "2 3\n0:1\n1:1 2:-2 2:3\n", **TEXTS)
    with pytest.raises(XCFormatError, match=r"trn_X_Y.txt:3: expected label values \(relevances\) >= 0.*data row 2"):
        read_dataset(bad)
    with pytest.raises(XCFormatError, match="at least one label of a training point"):  # only zeros: nothing
        read_dataset(split_sparse(tmp_path / "o", "2 3\n0:0\n1:0\n", **TEXTS))


@pytest.mark.parametrize("name", ["clicks.jsonl.gz", "clicks.csv.gz"])
def test_a_gzipped_click_log_bomb_is_refused_naming_the_file(tmp_path, name):
    """A click log of 100 MB of blank lines in a .gz of about 100 KB stops at the expansion cap (64 MiB here), with
    the file named, instead of being unpacked whole into memory."""
    path = tmp_path / name
    header = b"query,timestamp,label_id\n" if name.startswith("clicks.csv") else b""
    path.write_bytes(gzip.compress(header + b"\n" * (100 * MIB), compresslevel=9))
    assert path.stat().st_size < 300_000
    with pytest.raises(XCFormatError, match=f"{name}.*unpacks to at most 67,108,864 bytes"):
        read_click_log(path)
