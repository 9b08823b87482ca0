"""Packaging: pyproject.toml declares what the code imports, requirements*.txt agree with it, and `pip install .`
into a fresh virtual environment gives a working `kronos` command and CSV pipeline without pyqlib."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.readme_blocks import readme_block, shell_commands

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

packaging_req = pytest.importorskip("packaging.requirements")
from packaging.utils import canonicalize_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
OUR_PACKAGES = ("model", "finetune", "finetune_csv")
# Imported only by a mode that says so: the `store` benchmark's pandas baseline reads tests/csv_reference.py, from
# a source checkout (finetune/benchmarks/data.py documents it; --baseline-rows 0 skips it).
OPTIONAL_IMPORTS = {"tests"}
# Imported lazily where used, with an error naming the extra to install when missing.
LAZY_EXTRAS = {"mlflow": "mlflow", "peft": "lora", "holidays": "calendars", "optuna": "tune", "comet_ml": "comet",
               # `kronos serve` alone imports them (finetune_csv/serve.py); pydantic and starlette come with fastapi
               **dict.fromkeys(("fastapi", "uvicorn", "prometheus_client", "pydantic", "starlette"), "serve")}
# Modules only the Qlib pipeline imports (besides finetune/qlib_*.py).
QLIB_ONLY = {"finetune/evaluation/signals.py"}
# The distribution of an optional library's module when it is not installed here (no metadata to ask).
NOT_INSTALLED_DISTS = {"qlib": "pyqlib", "comet_ml": "comet-ml"}


def _req_set(lines: list[str]) -> set[str]:
    return {str(packaging_req.Requirement(line)) for line in lines}


def _requirement_lines(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith(("#", "-r", "-e", "--")):
            out.append(line)
    return out


def test_requirements_txt_agrees_with_pyproject():
    assert _req_set(_requirement_lines(ROOT / "requirements.txt")) == _req_set(PROJECT["dependencies"])


def test_requirements_dev_agrees_with_the_dev_extra():
    dev = ROOT / "requirements-dev.txt"
    assert "-r requirements.txt" in dev.read_text().splitlines()
    assert _req_set(_requirement_lines(dev)) == _req_set(PROJECT["optional-dependencies"]["dev"])


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(packaging_req.Requirement(r).name) for r in requirements}


def test_extras_and_torch_requirement():
    extras = PROJECT["optional-dependencies"]
    assert "pyqlib" in _names(extras["qlib"]) and "tensorboard" in _names(extras["tensorboard"])
    assert not {"pyqlib", "tensorboard"} & _names(PROJECT["dependencies"])  # the CSV pipeline installs without them
    torch = next(packaging_req.Requirement(r) for r in PROJECT["dependencies"] if r.startswith("torch"))
    # The torch installed here, and any later CUDA build of it, satisfy the requirement: pip never swaps the build.
    assert torch.specifier.contains(md.version("torch")) and torch.specifier.contains("99.0+cu999") and not torch.url
    # The lowest torch allowed has what the engine calls: torch.nn.utils.get_total_norm arrived in 2.6.0.
    assert torch.specifier.contains("2.6.0") and not torch.specifier.contains("2.5.1")
    dev = _names(extras["dev"])  # only tests compare with these CRPS references: no runtime dependency on them
    assert {"scoringrules", "properscoring"} <= dev and not {"scoringrules", "properscoring"} & _declared()
    assert "comet-ml" in _names(extras["comet"])  # training.comet has its extra


def test_console_script_points_at_the_cli(capsys):
    module, _, attr = PROJECT["scripts"]["kronos"].partition(":")
    assert getattr(importlib.import_module(module), attr)(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: kronos ")


def test_every_package_is_included():
    from setuptools import find_packages

    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(where=str(ROOT), include=include))
    inits = [p for top in OUR_PACKAGES for p in (ROOT / top).rglob("__init__.py")]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in inits}
    assert on_disk <= found


def _third_party_imports() -> dict[str, set[str]]:
    """{top-level module: files importing it} over model/, finetune/, finetune_csv/."""
    out: dict[str, set[str]] = {}
    for top in OUR_PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    mod = name.split(".")[0]
                    if mod not in sys.stdlib_module_names and mod not in OUR_PACKAGES:
                        out.setdefault(mod, set()).add(str(path.relative_to(ROOT)))
    return out


def _declared() -> set[str]:
    return {canonicalize_name(packaging_req.Requirement(r).name) for r in PROJECT["dependencies"]}


def test_every_imported_library_is_declared():
    declared = _declared()
    qlib_extra = {canonicalize_name(packaging_req.Requirement(r).name)
                  for r in PROJECT["optional-dependencies"]["qlib"]}
    dists = md.packages_distributions()
    problems = []
    for module, files in sorted(_third_party_imports().items()):
        if module in OPTIONAL_IMPORTS:
            continue
        names = {canonicalize_name(d) for d in dists.get(module, [])}
        if not names and module in NOT_INSTALLED_DISTS:  # e.g. pyqlib, an extra, absent here
            names = {canonicalize_name(NOT_INSTALLED_DISTS[module])}
        if names & declared:
            continue
        if module in LAZY_EXTRAS and LAZY_EXTRAS[module] in PROJECT["optional-dependencies"]:
            continue
        if names & qlib_extra and all(Path(f).name.startswith("qlib_") or f in QLIB_ONLY for f in files):
            continue  # the Qlib entry points import pyqlib lazily and name the extra when it is missing
        problems.append(f"{module} (distribution {sorted(names) or '?'}) imported by {sorted(files)}")
    assert not problems, "undeclared dependencies:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------------------------------------------
# a real install into a fresh virtual environment


def _closure(requirements: list[str]) -> list[md.Distribution]:
    """The installed distributions `requirements` need, recursively (markers evaluated here, extras off)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = packaging_req.Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.skip(f"{req.name} is not installed here, so it cannot be offered to the fresh environment")
        seen[name] = dist
        todo.extend(dist.requires or [])
    return list(seen.values())


def _link_site(dists: list[md.Distribution], site: Path) -> None:
    """A folder holding (symlinks to) exactly the files of `dists`: the only packages the fresh venv can see."""
    site.mkdir()
    for dist in dists:
        if dist.files is None:
            pytest.skip(f"{dist.metadata['Name']} has no RECORD; cannot tell its files")
        for top in {f.parts[0] for f in dist.files if f.parts and f.parts[0] not in ("..", "bin")}:
            target = Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv_gives_kronos_and_the_csv_pipeline(tmp_path):
    """`pip install .` with nothing but the declared dependencies visible.

    Tests must not need the network, so the declared dependencies come from THIS environment: their installed
    files (the recursive closure of pyproject's `dependencies`, plus pip and setuptools) are symlinked into one
    folder that a `.pth` file puts on the fresh venv's path. The venv does not see this environment's site-packages,
    so a library the code imports but pyproject does not declare (pyqlib included) is missing there, and a declared
    one that is not available fails `pip install --no-index`.
    """
    # pip and the build backend come from here too (the venv is made without pip: ensurepip's old setuptools
    # would shadow them and cannot build wheels without the `wheel` package).
    tools = PYPROJECT["build-system"]["requires"] + ["pip"]
    site = tmp_path / "declared_site"
    _link_site(_closure(PROJECT["dependencies"] + tools), site)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                   {"PATH": "/usr/bin:/bin"}).stdout.strip()
    (Path(purelib) / "declared_deps.pth").write_text(str(site) + "\n")

    src = tmp_path / "src"  # build from a copy: pip writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for top in OUR_PACKAGES:
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))

    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1"}
    res = _run([str(py), "-m", "pip", "install", "--no-index", "--no-build-isolation", str(src)], tmp_path, env)
    missing = re.search(r"No matching distribution found for ([A-Za-z0-9_.\-]+)", res.stderr)
    if res.returncode and missing and canonicalize_name(missing[1]) not in _declared():
        # e.g. a CUDA build of torch whose nvidia-* requirements are installed under other names: pip would have to
        # download them. The project's own declared dependencies must still resolve offline (else: fail).
        pytest.skip(f"{missing[1]} (required by an installed package, not by this project) cannot be installed "
                    "without downloading it")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    work = tmp_path / "elsewhere"  # outside the repository: nothing resolves to the source tree
    work.mkdir()
    res = _run([str(py), "-c", "import finetune, model, qlib"], work, env)
    assert "No module named 'qlib'" in res.stderr  # pyqlib is not a core dependency
    res = _run([str(py), "-c", "import finetune, model; print(finetune.__file__); print(model.__file__)"], work, env)
    assert res.returncode == 0 and all(line.startswith(purelib) for line in res.stdout.split()), res

    res = _run(["kronos", "--help"], work, env)
    assert res.returncode == 0 and "qlib-train-tokenizer" in res.stdout, res.stderr
    rule = ("import numpy as np; from finetune.evaluation.statistics import mean_interval; "
            "print(mean_interval(np.random.default_rng(0).standard_normal((1, 60)))['has_interval'][0])")
    res = _run([str(py), "-c", rule], work, env)  # the interval rule's table is package data
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr[-2000:]
    for command in shell_commands(readme_block("install")):  # the README's install section, as written
        if command[0] == "kronos":
            res = _run(command, work, env)
            assert res.returncode == 0 and res.stdout.strip(), (command, res.stderr[-2000:])

    res = _run(["kronos", "qlib-preprocess", "--config", str(ROOT / "configs/qlib_demo.yaml")], work, env)
    assert res.returncode == 6, res.stderr
    assert res.stderr.startswith("error: kronos qlib-preprocess needs the optional dependency 'qlib'")
    assert "pip install 'kronos-finetune[qlib]'" in res.stderr and "Traceback" not in res.stderr

    # Every command answers --help, and the three that once ran scripts/ files of a clone run from the package.
    listed = re.findall(r"^  ([a-z][a-z-]+)  ", _run(["kronos", "--help"], work, env).stdout, re.M)
    assert len(listed) >= 14 and {"make-synthetic", "build-qlib-store", "benchmark"} <= set(listed)
    for command in listed:
        res = _run(["kronos", command, "--help"], work, env)
        if command == "serve":  # FastAPI and uvicorn are its extra, not installed here: exit 6 with the install line
            assert res.returncode == 6 and "pip install 'kronos-finetune[serve]'" in res.stderr, res.stderr[-2000:]
            continue
        assert res.returncode == 0 and "usage: kronos" in res.stdout, (command, res.stderr[-2000:])
    res = _run(["kronos", "make-synthetic", "--out", "synthetic", "--n-series", "2", "--n-bars", "50"], work, env)
    assert res.returncode == 0 and sorted(os.listdir(work / "synthetic")) == ["SH600000.csv", "SH600001.csv"], res
    res = _run(["kronos", "build-qlib-store", "--synthetic", "2", "--out", "qlib_store", "--start", "2024-01-02",
                "--end", "2024-03-29"], work, env)
    assert res.returncode == 0 and (work / "qlib_store" / "instruments" / "csi300.txt").is_file(), res.stderr
    res = _run(["kronos", "benchmark", "csv_data", "--", "--series", "2", "--bars", "300", "--lookback", "16",
                "--predict", "4", "--batch", "4", "--batches", "2", "--steps", "1"], work, env)
    assert res.returncode == 0 and "store + WindowDataset" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]

    # The CSV pipeline end to end with the installed package: data, finetune (tiny, from scratch), forecast.
    gen = ("from finetune.synthetic import generate_ohlcv, write_csv_folder; "
           "write_csv_folder(generate_ohlcv(2, 700, freq='5min', start='2024-01-02', seed=0), 'candles')")
    assert _run([str(py), "-c", gen], work, env).returncode == 0
    cfg = yaml.safe_load((ROOT / "configs/csv_scratch_tiny.yaml").read_text())
    cfg["data"].update(path="candles", lookback=32, predict=8, stride=8)
    cfg["training"].update(epochs=1, batch_size=16)
    cfg["tokenizer_training"]["epochs"] = cfg["predictor_training"]["epochs"] = 1
    cfg["forecast"].update(max_windows=1, sample_count=2)
    (work / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    res = _run(["kronos", "finetune", "--config", "tiny.yaml"], work, env)
    assert res.returncode == 0, res.stderr[-4000:]
    for stage in ("tokenizer", "basemodel"):
        assert (work / "outputs/csv_scratch_tiny" / stage / "best_model/model.safetensors").is_file()
    res = _run(["kronos", "forecast", "--config", "tiny.yaml"], work, env)
    assert res.returncode == 0, res.stderr[-4000:]
    assert (work / "outputs/csv_scratch_tiny/forecast").is_dir()
    assert os.listdir(work / "outputs/csv_scratch_tiny/forecast")


def test_readme_install_section_names_every_command_and_extra():
    from finetune.cli import COMMANDS

    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## Install as a package", 1)[1].split("\n## ")[0]
    assert [name for name in COMMANDS if f"`{name}`" not in section] == []
    assert [extra for extra in PROJECT["optional-dependencies"] if f"`[{extra}]`" not in section] == []
