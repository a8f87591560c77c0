"""Result rows: appends keep what is stored, verbatim."""
import pandas as pd
import pytest

from hisparse.results import COLUMNS, append_rows


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


def test_rows_made_under_a_graph_experiment_say_so(tmp_path, monkeypatch):
    """HISPARSE_GRAPH_CAPTURE=driver or HISPARSE_GRAPH_FLAGS tag every row appended meanwhile; default
    rows carry neither column."""
    from hisparse import graph_flags
    path = tmp_path / "bench.csv"
    append_rows(path, [dict(bench="b", metric="us", value=1.0, unit="us")])
    assert "graph_capture" not in pd.read_csv(path) and "graph_flags" not in pd.read_csv(path)
    monkeypatch.setattr(graph_flags, "CAPTURE", "driver")
    monkeypatch.setattr(graph_flags, "FLAGS", 9)
    append_rows(path, [dict(bench="b", metric="us", value=2.0, unit="us")])
    frame = pd.read_csv(path)
    assert frame.graph_capture.isna().tolist() == [True, False] and frame.graph_capture[1] == "driver"
    assert frame.graph_flags.tolist()[1] == 9


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
