"""Result rows: appends keep what is stored, verbatim."""
import os
import subprocess
import sys

import pandas as pd
import pytest

from hisparse.results import COLUMNS, append_rows, current_commit


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
