"""Every YAML file in configs/ belongs to a pipeline whose loader is tested (csv_* or qlib_*)."""
from pathlib import Path

import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_every_config_has_a_known_pipeline_prefix_and_parses():
    files = sorted(CONFIGS.glob("*.y*ml"))
    assert files, "configs/ holds no YAML file"
    for path in files:
        assert path.name.startswith(("csv_", "qlib_")), f"{path.name}: name it csv_*.yaml or qlib_*.yaml"
        assert isinstance(yaml.safe_load(path.read_text()), dict), f"{path.name} is not a YAML mapping"


def test_both_pipelines_share_keys_and_defaults_for_the_same_concepts():
    from finetune.config import QlibConfig
    from finetune.utils.schema import SamplingConfig
    from finetune_csv.config import CsvFinetuneConfig

    qlib, csv = QlibConfig(), CsvFinetuneConfig()
    assert qlib.model == csv.model  # pretrained_tokenizer / _predictor, tokenizer_arch, predictor_arch
    assert qlib.training.resume == csv.training.resume == "auto"
    for stage in ("tokenizer_training", "predictor_training"):  # null = inherit training:
        assert getattr(qlib, stage) == getattr(csv, stage)
        assert all(v is None for v in vars(getattr(qlib, stage)).values())
    for name in vars(SamplingConfig()):
        assert getattr(qlib.forecast, name) == getattr(csv.forecast, name), name
    assert qlib.data.clip == csv.data.clip
    assert {"lookback", "predict", "clip"} <= set(vars(qlib.data)) & set(vars(csv.data))
