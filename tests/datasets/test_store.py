"""The one dataset loader: by path or by name under data/, a limit, and a missing set names its command."""

import pytest

from tsrl_cli.datasets.store import open_dataset, prepare_hint
from tsrl_cli.errors import UsageError


def test_open_by_path_with_limit(prepare_fixture, fixtures, tmp_path):
    out = prepare_fixture("terminal-bench", fixtures / "terminal_bench", tmp_path / "tb")
    ds = open_dataset(out)
    assert ds.name == "tb" and ds.path == out and len(ds.tasks) >= 2 and ds.manifest["kind"] == "terminal"
    assert [t.task_id for t in open_dataset(out, limit=1).tasks] == [ds.tasks[0].task_id]
    assert ds.pairs[0] == (out, ds.tasks[0])


@pytest.mark.parametrize("name,command", [("embedded_repair_train", "tsrl prepare-data embedded"),
                                          ("swebench_verified", "tsrl prepare-data swebench-verified"),
                                          ("mystery", "tsrl prepare-data SOURCE")])
def test_missing_dataset_says_how_to_make_it(name, command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="no such dataset") as e:
        open_dataset(name)
    assert command in str(e.value) and command in prepare_hint(name)
