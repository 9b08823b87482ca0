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
