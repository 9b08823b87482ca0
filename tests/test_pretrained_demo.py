"""checkpoints/demo-pretrained: the committed pair loads, matches, and encodes/decodes demo candles sensibly;
the scripts that build and measure it refuse to clobber and compute honest intervals."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from finetune.synthetic import generate_ohlcv
from finetune.utils.training_utils import predictor_loss
from finetune.utils.windows import SeriesArrays, WindowDataset
from finetune_csv.config import load
from model import Kronos, KronosPredictor, KronosTokenizer
from model.config import Window
from model.features import calc_time_stamps

REPO = Path(__file__).resolve().parents[1]
CKPT = REPO / "checkpoints" / "demo-pretrained"
FEATURES = ["open", "high", "low", "close", "volume", "amount"]


@pytest.fixture(scope="module")
def pair():
    return KronosTokenizer.from_pretrained(CKPT / "tokenizer"), Kronos.from_pretrained(CKPT / "predictor")


@pytest.fixture(scope="module")
def demo_windows():
    """16 windows (64 + 16 rows) of the demo market, normalised as the engine does: x (16, 80, 6), stamps."""
    df = generate_ohlcv(1, 2000, "5min", seed=0)["SH600000"]
    arrays = SeriesArrays(df[FEATURES].to_numpy(np.float32),
                          calc_time_stamps(df["timestamps"]).to_numpy(np.int64), "demo")
    ds = WindowDataset([arrays], Window(64, 16), stride=120)
    return ds.get_batch(np.arange(16))


def test_published_format_small_and_finite():
    for name in ("tokenizer", "predictor"):
        folder = CKPT / name
        window = ["kronos_predictor.json"] if name == "predictor" else []  # its training window (issue 48)
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", *window, "model.safetensors"]
        assert (folder / "model.safetensors").stat().st_size < 3 * 2**20  # a few MB at most
        weights = load_file(str(folder / "model.safetensors"))
        assert weights and all(torch.isfinite(v).all() for v in weights.values())
    readme = (CKPT / "README.md").read_text()
    for needed in ("make_pretrained_demo.py", "generate_mix", "seed", "git commit"):
        assert needed in readme


def test_pair_loads_and_token_sizes_match(pair):
    tokenizer, predictor = pair
    predictor.check_tokenizer(tokenizer, "checkpoints/demo-pretrained")  # raises on a mismatch
    assert (tokenizer.s1_bits, tokenizer.s2_bits) == (predictor.s1_bits, predictor.s2_bits)
    info = json.loads((CKPT / "training_info.json").read_text())
    assert info["predictor"]["best_val_loss"] < math.log(2**predictor.s1_bits)  # learnt something


def test_the_finetune_config_starts_from_this_checkpoint():
    cfg = load(REPO / "configs" / "csv_demo.yaml")
    assert (REPO / cfg.model.pretrained_tokenizer).resolve() == (CKPT / "tokenizer").resolve()
    assert (REPO / cfg.model.pretrained_predictor).resolve() == (CKPT / "predictor").resolve()


@torch.no_grad()
def test_encodes_and_decodes_a_demo_window(pair, demo_windows):
    tokenizer, predictor = pair
    tokenizer.eval()
    x, stamp = demo_windows  # (16, 80, 6), (16, 80, 5)
    s1, s2 = tokenizer.encode(x, half=True)  # (16, 80) each
    assert s1.shape == s2.shape == (16, 80)
    assert 0 <= int(s1.min()) and int(s1.max()) < 2**tokenizer.s1_bits and int(s2.max()) < 2**tokenizer.s2_bits
    assert len(torch.unique(s1)) >= 8  # the code book is used, not collapsed onto a few tokens
    x_hat = tokenizer.decode((s1, s2), half=True)
    mse = torch.mean((x_hat - x) ** 2).item()
    assert mse < 0.1 * torch.mean(x**2).item()  # far better than decoding everything to the window mean
    # Close prices: the decoded path follows the real one.
    corr = np.corrcoef(x_hat[..., 3].flatten().numpy(), x[..., 3].flatten().numpy())[0, 1]
    assert corr > 0.95
    predictor.eval()
    loss, _ = predictor_loss(predictor, tokenizer, x, stamp, teacher_forcing=True, causal_dep=True)
    assert math.isfinite(loss.item()) and loss.item() < 0.5 * math.log(2**predictor.s1_bits)  # beats uniform


def test_builder_refuses_to_overwrite_without_force(tmp_path):
    main = runpy.run_path(str(REPO / "scripts" / "make_pretrained_demo.py"))["main"]
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "mine.txt").write_text("user work")
    with pytest.raises(SystemExit, match="--force"):
        main(["--out", str(tmp_path / "ck"), "--work", str(tmp_path / "w")])
    assert (tmp_path / "ck" / "mine.txt").read_text() == "user work" and not (tmp_path / "w").exists()


def test_demo_interval_follows_the_one_rule():
    ci = runpy.run_path(str(REPO / "scripts" / "compare_pretrained_demo.py"))["mean_ci95"]
    days = pd.date_range("2024-01-01", periods=100, freq="D")
    rng = np.random.default_rng(0)
    values = rng.normal(0.3, 1.0, 100)
    lo, hi = ci(values, days)
    assert lo < values.mean() < hi and 0.2 < hi - lo < 0.8  # ~ 4 x 1/sqrt(100)
    assert ci(values[:6], days[:6]) is None  # 6 sessions: the rule claims no interval (the demo README's old case)


@pytest.mark.slow
def test_the_built_checkpoint_loads_as_a_forecaster_with_its_window(tmp_path):
    main = runpy.run_path(str(REPO / "scripts" / "make_pretrained_demo.py"))["main"]
    main(["--out", str(tmp_path / "ck"), "--work", str(tmp_path / "w"), "--n-series", "12", "--n-bars", "300",
          "--stride", "64", "--tokenizer-epochs", "1", "--predictor-epochs", "1", "--batch-size", "16"])
    predictor = KronosPredictor.from_pretrained(tmp_path / "ck" / "predictor", device="cpu")  # tokenizer recorded
    assert (predictor.max_context, predictor.lookback, predictor.clip) == (64 + 16, 64, 5.0)  # LOOKBACK, PREDICT


def test_python_and_the_cli_forecast_with_the_window_it_was_trained_on():
    """Issue 48 item 2: from_pretrained uses the recorded 64 + 16 (not 512 rows), as the CLI's zero-shot does, and
    both give the same forecast of the same daily history."""
    from finetune_csv.forecast import zero_shot_predictor

    python = KronosPredictor.from_pretrained(CKPT / "predictor", device="cpu")  # tokenizer: the recorded ../tokenizer
    cli = zero_shot_predictor(load(REPO / "configs" / "csv_us_daily.yaml"))
    assert (python.lookback, python.max_context, python.clip) == (64, 64 + 16, 5.0)
    assert cli.lookback == python.lookback and cli.clip == python.clip
    rng = np.random.default_rng(0)
    close = 400 * np.exp(np.cumsum(rng.normal(0, 0.01, 300)))
    df = pd.DataFrame({"timestamps": pd.bdate_range("2020-01-02", periods=300), "open": close, "high": close * 1.01,
                       "low": close * 0.99, "close": close, "volume": 1e6})
    a, b = (kp.predict_df(df, prediction_length=5) for kp in (python, cli))
    pd.testing.assert_frame_equal(a, b)
    assert abs(a["close"].iloc[0] / close[-1] - 1) < 0.05  # not the 13.5% drop of a 512-row context
