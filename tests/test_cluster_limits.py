"""A full disk at any checkpoint or best-model write is one line naming the file, the free
space, the bytes needed and the pipeline's own output setting (nothing half-written); a YAML file built to exhaust
memory (billion laughs) is refused or reported in a short line."""

from __future__ import annotations

import errno

import pytest
import torch
from safetensors import SafetensorError

import finetune.utils.checkpoint as checkpoint_store
import model.hub
from finetune.utils.config_utils import MAX_YAML_ALIASES, load_config
from finetune.utils.errors import run_main
from finetune.utils.schema import TrainingConfig
from finetune_csv import train_sequential
from model.errors import ConfigError
from model.fileio import disk_full
from tests.test_csv_train import make_run

RUST_ENOSPC = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


def laughs(levels: int, width: int = 9) -> str:
    """A billion-laughs YAML: level k lists `width` aliases of level k-1; `mlflow_experiment` (a str) gets it."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for k in range(1, levels):
        lines.append(f"l{k}: &l{k} [" + ", ".join([f"*l{k - 1}"] * width) + "]")
    return "\n".join(lines) + f"\nmlflow_experiment: *l{levels - 1}\n"


def test_yaml_with_too_many_aliases_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(levels=20))  # 9^20 leaves: any expansion would never finish
    with pytest.raises(ConfigError, match=f"more than {MAX_YAML_ALIASES} YAML aliases") as e:
        load_config(TrainingConfig, path)
    assert str(path) in str(e.value)


def test_a_few_aliases_load_and_a_nested_wrong_value_is_shown_short(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(levels=9, width=9))  # 73 aliases, 9^9 leaves if expanded; allowed
    with pytest.raises(ConfigError) as e:
        load_config(TrainingConfig, path)
    line = next(p for p in e.value.problems if p.startswith("mlflow_experiment"))
    assert "expected" in line and len(line) < 200


def test_an_oversized_settings_file_is_refused(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("# padding\n" * 200_000)
    with pytest.raises(ConfigError, match="too large for a settings file"):
        load_config(TrainingConfig, path)


def test_csv_pipeline_refuses_the_billion_laughs_file_with_exit_2(tmp_path, capsys):
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(levels=20))
    assert run_main(train_sequential.main, ["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "YAML aliases" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ full disk
def full_disk_at(monkeypatch, target: str, error: BaseException) -> None:
    """Make the write of the chosen file fail as on a full disk: 'best' = model.safetensors of best_model/
    (safetensors raises its own error type), 'checkpoint' = the step file."""
    if target == "best":
        def save_file(*args, **kwargs):
            raise error
        monkeypatch.setattr(model.hub, "save_file", save_file)
    else:
        def save_to(state, tmp):
            raise error
        monkeypatch.setattr(checkpoint_store, "_save_to", save_to)


@pytest.mark.parametrize(("target", "error"), [
    ("best", SafetensorError(RUST_ENOSPC)),
    ("best", OSError(errno.ENOSPC, "No space left on device")),
    ("checkpoint", OSError(errno.ENOSPC, "No space left on device")),
    ("checkpoint", RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing")),
])
def test_full_disk_in_the_csv_pipeline_is_one_line_naming_paths_base_dir(tmp_path, monkeypatch, capsys, target,
                                                                         error):
    config = make_run(tmp_path)
    full_disk_at(monkeypatch, target, error)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = run_main(train_sequential.main, ["--config", str(config)])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert code == 3, err
    assert "Traceback" not in err
    line = next(x for x in err.splitlines() if x.startswith("error:"))
    name = "model.safetensors" if target == "best" else "step-"
    assert name in line and " free on that disk" in line and " needed" in line, line
    assert "set paths.base_dir to a folder on a larger disk" in line, line
    stage = tmp_path / "out" / "tiny" / "tokenizer"
    # Nothing half-written: no temporary files or folders, no best_model/ without weights.
    assert not [p for p in stage.rglob(".*") if p.name != ".gitignore"]
    best = stage / "best_model"
    assert not best.exists() or (best / "model.safetensors").is_file()


def test_space_error_names_the_key_it_is_given(tmp_path):
    e = checkpoint_store.space_error(tmp_path / "x.pt", 10 << 20, OSError(errno.ENOSPC, "full"))
    named = checkpoint_store.space_error(tmp_path / "x.pt", 10 << 20, OSError(errno.ENOSPC, "full"), "k")
    assert "training.output_dir" in str(e)
    assert "set k to a folder" in str(named) and "training.output_dir" not in str(named)
    assert str(tmp_path / "x.pt") in str(named) and "10.0 MiB needed" in str(named) and named.needed == 10 << 20


def test_safetensors_disk_full_text_counts_as_a_space_error():
    assert disk_full(SafetensorError(RUST_ENOSPC))
    assert not disk_full(SafetensorError("Error while serializing: bad dtype"))


# ------------------------------------------------------------------------------------------ line numbers
def test_error_line_numbers_count_the_blank_lines_the_reader_skips(tmp_path):
    from finetune_csv.config import DataConfig
    from finetune_csv.prepare import prepare_data
    from finetune_csv.sources import blank_lines
    from tests.csv_reference import candles

    text = candles(30).to_csv(index=False).splitlines()
    text[5] = text[5].replace(text[5].split(",")[1], "abc", 1)  # file line 6: a non-number in 'open'
    text = text[:3] + ["", "\r"] + text[3:]  # two empty lines before it: now it is line 8
    path = tmp_path / "a.csv"
    path.write_text("\n".join(text) + "\n")
    assert blank_lines(path).tolist() == [4, 5] and blank_lines(path, chunk=7).tolist() == [4, 5]
    with pytest.raises(ValueError) as e:
        prepare_data(DataConfig(path=str(path), lookback=4, predict=2), tmp_path / "store")
    assert "at line(s) 8" in str(e.value), str(e.value)
