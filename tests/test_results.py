"""Result rows: appends keep what is stored, verbatim."""
import codecs
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from hisparse.results import COLUMNS, append_rows, current_commit, read_stored_rows, stored_table


def test_append_keeps_old_rows_verbatim(tmp_path):
    path = tmp_path / "bench.csv"
    append_rows(path, [dict(bench="b", mode="m", cache_slots=4096, metric="us", value=1.5, unit="us")])
    first = path.read_text().splitlines()
    append_rows(path, [dict(bench="b", mode="m", metric="us", value=2.5, unit="us", extra="x")])
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert lines[1].startswith(first[1]) and ",4096," in lines[1], "an old row must not be reformatted"
    frame = pd.read_csv(path)
    assert list(frame.columns[:len(COLUMNS)]) == COLUMNS and frame.extra.tolist()[1] == "x"


def test_rows_without_required_columns_are_refused_and_nothing_is_written(tmp_path):
    path = tmp_path / "bench.csv"
    with pytest.raises(ValueError, match=r"lacks the columns \['unit'\]"):
        append_rows(path, [dict(bench="b", metric="us", value=1.0)])
    assert not path.exists()


@pytest.mark.parametrize("text, problem", [
    ("bench,metric,value,unit\nb,m,1,us,\n", "line 2 has 5 fields, the header 4"),       # a trailing comma
    ("bench,metric,value,unit\nx,b,m,1,us\nx,b,m,2,us\n", "(2 such lines)"),           # a leading field
    ("x,y\n1,2\n", "lacks ['bench', 'metric', 'unit', 'value']"),                        # not a results file
    ("bench;metric;value;unit\nb;m;1;us\n", "lacks"),                                     # another separator
    ("bench,metric,value,unit,note,note\nb,m,1,us,a,b\n", "empty or repeated column name"),
    ("bench,metric,value,unit,\nb,m,1,us,\n", "empty or repeated column name"),
])
def test_a_file_that_is_not_a_results_csv_is_refused_and_left_as_it_was(tmp_path, text, problem):
    path = tmp_path / "bench.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match="is not a results CSV") as err:
        append_rows(path, [dict(bench="b", metric="us", value=1.0, unit="us")])
    assert problem in str(err.value) and str(path) in str(err.value)
    assert path.read_text() == text and not path.with_suffix(".csv.tmp").exists()


def test_rows_must_be_a_list_of_dicts(tmp_path):
    path = tmp_path / "bench.csv"
    with pytest.raises(TypeError, match="expected a list of dicts"):
        append_rows(path, dict(bench="b", metric="us", value=1.0, unit="us"))
    with pytest.raises(TypeError, match=r"of \['str'\]"):
        append_rows(path, ["bench"])
    with pytest.raises(TypeError, match="got generator"):          # not consumed into an empty append
        append_rows(path, (dict(bench="b", metric="us", value=1.0, unit="us") for _ in range(2)))
    assert not path.exists()


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_the_commit_stamp_says_dirty_for_code_only_and_unknown_outside_its_own_checkout(tmp_path, monkeypatch):
    """Rows a run appends to results/ do not make its later rows look dirty; a changed or new code
    file does; a copy inside another project's repository is not stamped with that project's commit."""
    monkeypatch.delenv("HISPARSE_COMMIT", raising=False)
    (tmp_path / "results").mkdir()
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "results" / "bench.csv").write_text("bench\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    sha = current_commit(tmp_path)
    assert len(sha) == 12 and not sha.endswith("-dirty")
    (tmp_path / "results" / "bench.csv").write_text("bench\nb\n")          # a run's rows
    (tmp_path / "results" / "new.csv").write_text("bench\n")
    (tmp_path / "notes.txt").write_text("scratch\n")
    assert current_commit(tmp_path) == sha
    (tmp_path / "new_module.py").write_text("y = 2\n")                     # new code, not yet added
    assert current_commit(tmp_path) == sha + "-dirty"
    (tmp_path / "new_module.py").unlink()
    (tmp_path / "code.py").write_text("x = 3\n")
    assert current_commit(tmp_path) == sha + "-dirty"
    (tmp_path / "vendor" / "copy").mkdir(parents=True)
    with pytest.warns(RuntimeWarning, match="stamped commit 'unknown'.*another project's"):
        assert current_commit(tmp_path / "vendor" / "copy") == "unknown"


def test_appends_keep_the_files_header_and_refuse_bad_column_names_and_partial_stamps(tmp_path):
    path = tmp_path / "bench.csv"
    path.write_text("value,bench,metric,unit,seed\n")                      # its own order, an extra column
    append_rows(path, [dict(bench="b", metric="us", value=1.0, unit="us", seed=3, new=1)])
    header = path.read_text().splitlines()[0].split(",")
    assert header[:5] == ["value", "bench", "metric", "unit", "seed"] and header[-1] == "new"
    before = path.read_text()
    for row, message in [(dict(bench="b", metric="us", value=1.0, unit="us", **{"": 1}), "column name ''"),
                         (dict(bench="b", metric="us", value=1.0, unit="us", gpu="H200", commit=""),
                          r"sets \['gpu', 'commit'\]: a row brings all of")]:
        with pytest.raises(ValueError, match=message):
            append_rows(path, [row])
    assert path.read_text() == before
    imported = dict(bench="b", metric="us", value=2.0, unit="us", gpu="NVIDIA H200", torch="2.11", triton="3.6",
                    commit="abc", timestamp="2026-12-01T00:00:00+00:00")
    append_rows(path, [imported])
    assert pd.read_csv(path).iloc[-1][["gpu", "commit"]].tolist() == ["NVIDIA H200", "abc"]


def test_concurrent_appends_lose_no_row(tmp_path):
    path = tmp_path / "bench.csv"
    code = ("import sys\nfrom hisparse.results import append_rows\n"
            "for i in range(15):\n"
            "    append_rows(sys.argv[1], [dict(bench='b', metric='m', value=i, unit='', writer=sys.argv[2])])\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(w)], env={**os.environ,
                              "HISPARSE_COMMIT": "test"}) for w in range(2)]
    assert all(p.wait() == 0 for p in procs)
    assert len(pd.read_csv(path)) == 30 and not list(tmp_path.glob("*.tmp"))


def test_an_append_keeps_the_files_mode_and_a_new_file_gets_the_umask_mode(tmp_path):
    """The rewrite through a temporary file and a rename does not leave a 0600 file: an existing file
    keeps its mode, a new one gets what open() would give it (0666 less the umask)."""
    row = dict(bench="b", metric="us", value=1.0, unit="us")
    old_umask = os.umask(0o027)
    try:
        append_rows(tmp_path / "new.csv", [row])
    finally:
        os.umask(old_umask)
    assert (tmp_path / "new.csv").stat().st_mode & 0o7777 == 0o640
    path = tmp_path / "bench.csv"
    append_rows(path, [row])
    for mode in (0o644, 0o664, 0o604):
        path.chmod(mode)
        append_rows(path, [row])
        assert path.stat().st_mode & 0o7777 == mode
    assert len(pd.read_csv(path)) == 4


def test_an_append_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path):
    """A results CSV that is a link (here a relative one, into another folder) gets its rows in the
    link's target; the link stays the link it was. A link to a file not there yet makes that file."""
    (tmp_path / "store").mkdir()
    (tmp_path / "out").mkdir()
    target, link = tmp_path / "store" / "bench.csv", tmp_path / "out" / "bench.csv"
    append_rows(target, [dict(bench="b", metric="us", value=1.0, unit="us")])
    target.chmod(0o644)
    link.symlink_to(Path("..") / "store" / "bench.csv")
    append_rows(link, [dict(bench="b", metric="us", value=2.0, unit="us")])
    assert link.is_symlink() and os.readlink(link) == str(Path("..") / "store" / "bench.csv")
    assert pd.read_csv(target)["value"].tolist() == [1.0, 2.0] and target.stat().st_mode & 0o7777 == 0o644
    assert not list((tmp_path / "out").glob("*.tmp")) and not list((tmp_path / "store").glob("*.tmp"))
    dangling = tmp_path / "out" / "later.csv"
    dangling.symlink_to(tmp_path / "store" / "later.csv")
    append_rows(dangling, [dict(bench="b", metric="us", value=3.0, unit="us")])
    assert dangling.is_symlink() and pd.read_csv(tmp_path / "store" / "later.csv")["value"].tolist() == [3.0]


def test_a_failed_write_leaves_the_file_its_mode_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "bench.csv"
    append_rows(path, [dict(bench="b", metric="us", value=1.0, unit="us")])
    path.chmod(0o644)
    before = path.read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pd.DataFrame, "to_csv", full_disk)
    with pytest.raises(OSError, match="No space left"):
        append_rows(path, [dict(bench="b", metric="us", value=2.0, unit="us")])
    assert path.read_bytes() == before and path.stat().st_mode & 0o7777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.csv"]


def test_a_csv_with_a_byte_order_mark_is_read_and_keeps_its_mark(tmp_path):
    """A results CSV saved by a spreadsheet as "CSV UTF-8" starts with a byte-order mark: its header
    still names bench (not '\\ufeffbench'), and an append keeps the file as it was, mark and rows."""
    path = tmp_path / "bench.csv"
    text = "bench,metric,value,unit,note\nb,us,1,us,caf\u00e9\n"
    path.write_bytes(codecs.BOM_UTF8 + text.encode())
    assert read_stored_rows(path).columns[0] == "bench"
    append_rows(path, [dict(bench="b", metric="us", value=2.0, unit="us")])
    data = path.read_bytes()
    assert data.startswith(codecs.BOM_UTF8) and not data[3:].startswith(codecs.BOM_UTF8)
    lines = data[3:].decode().splitlines()
    assert lines[0].startswith("bench,metric,value,unit,note,") and lines[1].startswith("b,us,1,us,caf\u00e9,")
    assert pd.read_csv(path)["value"].tolist() == [1.0, 2.0]


def test_a_file_that_is_not_utf8_text_is_refused_by_name(tmp_path):
    path = tmp_path / "bench.csv"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    with pytest.raises(ValueError, match="is not a results CSV") as err:
        append_rows(path, [dict(bench="b", metric="us", value=1.0, unit="us")])
    assert str(path) in str(err.value) and "not UTF-8 text (byte 0x89 at offset 0)" in str(err.value)
    assert path.read_bytes() == b"\x89PNG\r\n\x1a\n\x00\xff\xfe"
    path.write_bytes(codecs.BOM_UTF8 + b"bench,metric,value,unit\nb,m,\xff,us\n")     # offsets count the mark
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 0xff at offset 31\)"):
        read_stored_rows(path)


def test_stored_rows_are_indexed_by_the_line_they_start_on(tmp_path):
    path = tmp_path / "bench.csv"
    path.write_text('bench,metric,value,unit\nb,m,1,us\n\nb,"two\nlines",2,us\nb,m,3,us\n')
    assert read_stored_rows(path).index.tolist() == [2, 4, 6]
    path.write_text('bench,metric,value,unit\nb,"two\nlines",2,us\nb,m,3,us,\n')
    with pytest.raises(ValueError, match="line 4 has 5 fields, the header 4"):
        read_stored_rows(path)


def test_a_loop_of_symlinks_is_refused_and_left_a_link(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.symlink_to(b)
    b.symlink_to(a)
    with pytest.raises(OSError, match="a loop of symlinks"):
        append_rows(a, [dict(bench="b", metric="us", value=1.0, unit="us")])
    assert a.is_symlink() and b.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "b.csv"]


def test_rows_with_new_columns_rewrite_the_file_under_the_union_header_old_rows_intact(tmp_path):
    """New columns widen the header (the file's own order first, the new ones after); every old
    row keeps each field as it was, text and quoting included, and gets one empty field per new
    column (the only change to its line); every line has the header's field count."""
    path = tmp_path / "decode.csv"
    append_rows(path, [dict(bench="decode", mode="m", cache_slots=4096, metric="tpot_ms", value="1.50", unit="ms",
                            note="a, b \"quoted\"")])
    append_rows(path, [dict(bench="decode", metric="tpot_ms", value=2.0, unit="ms")])
    before = path.read_text().splitlines()
    append_rows(path, [dict(bench="decode", mode="m", metric="tpot_ms", value=3.0, unit="ms", prefetch=True,
                            graph=False)])
    after = path.read_text().splitlines()
    header, body, _ = stored_table(path)
    assert header == before[0].split(",") + ["prefetch", "graph"] and after[0] == before[0] + ",prefetch,graph"
    assert [after[i] for i in (1, 2)] == [before[i] + ",," for i in (1, 2)]
    assert all(len(row) == len(header) for row in body.values())
    old = read_stored_rows(path)
    assert old.loc[2, "value"] == "1.50" and old.loc[2, "cache_slots"] == "4096"
    assert old.loc[2, "note"] == 'a, b "quoted"' and old.loc[2, "prefetch"] == ""
    assert old.loc[4, "prefetch"] == "True" and old.loc[4, "graph"] == "False" and old.loc[4, "note"] == ""
    append_rows(path, [dict(bench="decode", metric="tpot_ms", value=4.0, unit="ms")])   # fewer columns: kept
    assert path.read_text().splitlines()[:4] == after


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU: its rows belong in results/")
def test_cpu_rows_of_a_timed_bench_never_go_into_the_committed_results(tmp_path, monkeypatch, capsys):
    """append_rows refuses them (nothing written), the policy study's host rows and rows measured on
    a GPU elsewhere pass; check_out_folder refuses such an --out before the run, and says where rows go."""
    import argparse

    import hisparse.results as results
    committed = tmp_path / "results"
    monkeypatch.setattr(results, "COMMITTED_RESULTS", committed)
    with pytest.raises(ValueError, match=r"--out .*results is the committed results, which hold GPU rows only .* "
                                         r"these decode rows come from a machine without a GPU"):
        append_rows(committed / "decode.csv", [dict(bench="decode", metric="tpot_ms", value=1.0, unit="ms")])
    assert not (committed / "decode.csv").exists()
    append_rows(committed / "policies.csv", [dict(bench="policies", metric="miss_rate", value=0.1, unit="fraction"),
                                             dict(bench="newest_token", metric="newest_miss_share", value=0.01,
                                                  unit="fraction")])
    append_rows(committed / "decode.csv", [dict(bench="decode", metric="tpot_ms", value=1.0, unit="ms",
                                                gpu="NVIDIA H200", torch="2.11", triton="3.6", commit="abc",
                                                timestamp="2026-01-01T00:00:00+00:00")])
    parser = argparse.ArgumentParser()
    with pytest.raises(SystemExit):
        results.check_out_folder(parser, committed)
    assert "which hold GPU rows only" in capsys.readouterr().err
    results.check_out_folder(parser, committed, host_only=True)
    results.check_out_folder(parser, tmp_path / "mine")
    printed = capsys.readouterr().out
    assert f"result rows go to {committed}/ (the committed results)" in printed
    assert f"result rows go to {tmp_path / 'mine'}/\n" in printed


def test_the_default_out_is_a_folder_git_ignores():
    """Every command's default --out is out/, which the checkout's .gitignore covers."""
    from hisparse.results import DEFAULT_OUT, PACKAGE_ROOT, out_note
    assert DEFAULT_OUT == "out" and out_note(PACKAGE_ROOT / "out" / "sweep") == " (git ignores it)"
    ignored = subprocess.run(["git", "check-ignore", "-q", "out/decode.csv"], cwd=PACKAGE_ROOT)
    if (PACKAGE_ROOT / ".git").exists():
        assert ignored.returncode == 0, "out/ is not git-ignored"
