"""kvlab.tools.compare_runs: two runs' Parquet rows, equal but for wall-clock columns, or the difference named."""

from __future__ import annotations

import pandas as pd

from kvlab.tools.compare_runs import compare, main


def run(root, rows: dict[str, pd.DataFrame]):
    for rel, frame in rows.items():
        path = root / "results" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(path)
    return root


def rows(score=(1.0, 0.0), seconds=(0.5, 0.7), methods=("full", "snapkv")):
    return pd.DataFrame({"method": list(methods), "score": list(score), "decode_s": list(seconds), "decode_batch": [2] * len(methods)})


def test_equal_rows_with_other_timings_are_the_same(tmp_path):
    old = run(tmp_path / "old", {"eval/a.parquet": rows()})
    new = run(tmp_path / "new", {"eval/a.parquet": rows(seconds=(9.0, 1.0))})
    assert compare(old, new) == ["results/eval/a.parquet: same (2 rows)"]
    assert main([str(old), str(new)]) == 0


def test_a_changed_score_or_a_missing_file_is_named(tmp_path, capsys):
    old = run(tmp_path / "old", {"eval/a.parquet": rows(), "eval/b.parquet": rows()})
    new = run(tmp_path / "new", {"eval/a.parquet": rows(score=(1.0, 1.0))})
    lines = compare(old, new)
    assert lines[0].startswith("results/eval/a.parquet: differs: ") and "score" in lines[0]
    assert lines[1] == f"results/eval/b.parquet: only in {old}"
    assert main([str(old), str(new)]) == 1 and "differs" in capsys.readouterr().out


def test_an_added_method_is_left_out_of_the_new_run_only(tmp_path):
    old = run(tmp_path / "old", {"eval/a.parquet": rows()})
    more = pd.DataFrame({"method": ["full", "snapkv", "lmdeploy4"], "score": [1.0, 0.0, 0.0], "decode_s": [1.0] * 3, "decode_batch": [3] * 3})
    new = run(tmp_path / "new", {"eval/a.parquet": more})
    assert compare(old, new)[0].startswith("results/eval/a.parquet: differs")  # three rows against two
    assert compare(old, new, ("lmdeploy4",)) == ["results/eval/a.parquet: same (2 rows)"]
