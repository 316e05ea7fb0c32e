import json

import pytest

from fedrl.adapter_record import RECORD, read_record
from fedrl.strategies.best_adapter import BestAdapter, best_adapter_note

RECORD_FIELDS = dict(model="tiny-base", task="reversal", task_params="{}")


def writer(saved: list):
    def save(directory):
        (directory / "adapter_model.safetensors").write_text(f"weights {len(saved)}")
        saved.append(directory)

    return save


def test_the_lowest_error_is_kept_and_a_tie_keeps_the_earlier_version(tmp_path):
    best, saved = BestAdapter(tmp_path / "best"), []
    kept = [best.offer(e, v, writer(saved), RECORD_FIELDS) for v, e in enumerate([0.5, 0.6, 0.5, 0.3, 0.4])]
    assert kept == [True, False, False, True, False] and len(saved) == 2
    record = read_record(tmp_path / "best")
    assert (record["version"], record["best_eval"]) == (3, 0.3) and record["model"] == "tiny-base"
    assert (tmp_path / "best" / "adapter_model.safetensors").read_text() == "weights 1"
    assert best.summary() == {"version": 3, "error": 0.3, "adapter_dir": str(tmp_path / "best")}


def test_a_resumed_run_takes_its_bar_from_what_an_earlier_life_kept(tmp_path):
    BestAdapter(tmp_path).offer(0.2, 7, writer([]), RECORD_FIELDS)
    again, saved = BestAdapter(tmp_path), []
    assert again.summary() is None  # a new run's bar is its own first eval, whatever the folder holds
    again.resume()
    assert not again.offer(0.25, 9, writer(saved), RECORD_FIELDS) and not saved
    assert again.summary()["version"] == 7
    assert again.offer(0.1, 9, writer(saved), RECORD_FIELDS) and read_record(tmp_path)["version"] == 9


@pytest.mark.parametrize("record", [None, "{not json", json.dumps({"model": 1})])
def test_a_record_missing_or_garbled_sets_no_bar(tmp_path, record):
    (tmp_path / "adapter_model.safetensors").write_text("weights of an interrupted write")
    if record is not None:
        (tmp_path / RECORD).write_text(record)
    best = BestAdapter(tmp_path)
    best.resume()
    assert best.summary() is None
    assert best.offer(0.9, 1, writer([]), RECORD_FIELDS) and read_record(tmp_path)["best_eval"] == 0.9


def test_a_write_cut_short_leaves_no_record_that_describes_other_weights(tmp_path):
    best = BestAdapter(tmp_path)
    best.offer(0.5, 1, writer([]), RECORD_FIELDS)

    def killed(directory):
        (directory / "adapter_model.safetensors").write_text("half")
        raise OSError("killed mid-write")

    with pytest.raises(OSError):
        best.offer(0.1, 2, killed, RECORD_FIELDS)
    assert not (tmp_path / RECORD).exists()
    resumed = BestAdapter(tmp_path)
    resumed.resume()
    assert resumed.summary() is None


def test_the_note_names_the_best_adapter_only_when_it_is_not_the_final_version():
    best = {"version": 3, "error": 0.25, "adapter_dir": "/r/adapter-best"}
    said = best_adapter_note({"versions": 7, "best_adapter": best})
    assert said == "the held-out error was lowest, 0.250 at v3, in the adapter /r/adapter-best"
    assert best_adapter_note({"versions": 3, "best_adapter": best}) is None  # the final one is the best
    assert best_adapter_note({"versions": 3, "best_adapter": None}) is None  # a run with no eval kept
