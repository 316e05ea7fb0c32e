import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedrl.adapter_record import RECORD, read_record, write_record
from fedrl.cli.main import main
from fedrl.lora import build_adapter_model

TRAINED_ON = {"model": "tiny", "task": "reversal", "task_params": '{"length": 4, "num_eval": 8}'}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A tiny adapter as a run exports it: PEFT's files and the record of what it trained on."""
    folder = tmp_path_factory.mktemp("adapter")
    build_adapter_model("tiny", 8, 16.0, 3).lm.model.save_pretrained(folder)
    write_record(folder, **TRAINED_ON, version=3, final_eval=0.5)
    return folder


def test_a_record_round_trips_and_a_peft_only_adapter_has_none(tmp_path, adapter_dir):
    assert read_record(adapter_dir) == {**TRAINED_ON, "version": 3, "final_eval": 0.5}
    assert read_record(tmp_path) == {}
    with pytest.raises(ValueError, match="needs \\['task_params'\\]"):
        write_record(tmp_path, model="tiny", task="reversal")
    (tmp_path / RECORD).write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        read_record(tmp_path)
    (tmp_path / RECORD).write_text(json.dumps({"model": "tiny", "task": 3, "task_params": "{}"}))
    with pytest.raises(ValueError, match="must name the adapter's model, task, task_params as strings"):
        read_record(tmp_path)


def test_eval_takes_the_model_and_task_from_the_adapter_unless_told(adapter_dir, capsys):
    assert main(["eval", "--adapter", str(adapter_dir)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["model"] == "tiny" and result["task"] == "reversal" and result["problems"] == 8
    # what is given wins: 16 held-out problems, not the record's 8
    given = '{"length": 4, "num_eval": 16}'
    assert main(["eval", "--adapter", str(adapter_dir), "--task-params", given]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["problems"] == 16


def test_an_adapter_that_does_not_fit_the_model_is_one_line(adapter_dir, tmp_path, capsys):
    """Before: torch's size mismatch, a line per tensor, through a traceback."""
    for f in adapter_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(tmp_path / "adapter_model.safetensors")
    name = next(n for n in sorted(weights) if "lora_B" in n)
    weights[name] = torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])  # another width
    save_file(weights, tmp_path / "adapter_model.safetensors")
    assert main(["eval", "--adapter", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    said = f"the adapter in {tmp_path} does not fit model 'tiny' (it was trained on 'tiny'): size mismatch"
    assert said in err


def test_a_folder_without_an_adapter_is_one_line_naming_a_run_folders_adapters(adapter_dir, tmp_path, capsys):
    """Before: peft's "Can't find 'adapter_config.json'", also for the run folder that holds two."""
    nowhere = tmp_path / "nowhere"
    assert main(["eval", "--adapter", str(nowhere)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fedrl eval: error: no PEFT adapter in {nowhere} (no adapter_config.json there)"
    run = tmp_path / "run"
    for name in ("adapter", "adapter-best"):
        (run / name).mkdir(parents=True)
        for f in adapter_dir.iterdir():
            (run / name / f.name).write_bytes(f.read_bytes())
    assert main(["eval", "--adapter", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"it is a run's output folder: give {run / 'adapter'} or {run / 'adapter-best'}"), err
    assert main(["eval", "--adapter", str(run / "adapter-best")]) == 0  # what it names loads
