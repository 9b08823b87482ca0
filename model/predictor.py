"""KronosPredictor: DataFrame in, forecast DataFrame out (the interface existing Kronos user code calls)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from .features import FEATURE_COLS, calc_time_stamps, candle_matrix, check_increasing, normalize, to_datetime_index
from .generation import generate_tokens
from .kronos import Kronos
from .tokenizer import KronosTokenizer


@dataclass
class Forecast:
    """A forecast with its sample paths: `mean` (pred_len rows, FEATURE_COLS), `samples` (S, pred_len, 6) and
    `quantiles` {q: DataFrame}, all in the input's units and indexed by the forecast timestamps."""

    mean: pd.DataFrame
    samples: np.ndarray
    quantiles: dict[float, pd.DataFrame] = field(default_factory=dict)


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda:0"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


class KronosPredictor:
    """Forecast candles with a Kronos predictor and its tokenizer.

    max_context: the predictor's window (512 for Kronos-small/base); clip: normalised values are clipped to
    [-clip, clip]. `use_cache=False` selects the plain full-recompute generator (same numbers, slower).
    """

    def __init__(self, model: Kronos, tokenizer: KronosTokenizer, device: str | None = None, max_context: int = 512,
                 clip: float = 5, use_cache: bool = True):
        self.device = torch.device(device or default_device())
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer.to(self.device).eval()
        self.max_context = int(max_context)
        self.clip = clip
        self.use_cache = use_cache
        self.price_cols = FEATURE_COLS[:4]
        self.vol_col, self.amt_vol = "volume", "amount"

    # ---------------------------------------------------------------- public
    def predict(self, df: pd.DataFrame, x_timestamp, y_timestamp, pred_len: int, T: float = 1.0,
                top_k: int | None = 0, top_p: float | None = 0.9, sample_count: int = 1, verbose: bool = True,
                return_samples: bool = False, quantiles: list[float] | None = None):
        """Forecast `pred_len` candles after `df`.

        df: context candles (T rows; open/high/low/close required, volume/amount optional); x_timestamp: T
        datetimes; y_timestamp: pred_len datetimes. Returns a DataFrame (pred_len, 6) of the mean over
        `sample_count` paths, indexed by y_timestamp; with `return_samples` or `quantiles`, a `Forecast`.
        """
        out = self.predict_batch([df], [x_timestamp], [y_timestamp], pred_len, T, top_k, top_p, sample_count,
                                 verbose, return_samples, quantiles)
        return out[0]

    def predict_batch(self, df_list, x_timestamp_list, y_timestamp_list, pred_len: int, T: float = 1.0,
                      top_k: int | None = 0, top_p: float | None = 0.9, sample_count: int = 1, verbose: bool = True,
                      return_samples: bool = False, quantiles: list[float] | None = None):
        """Forecast several series of equal context length in one batch; returns a list as `predict` does."""
        self._check_options(pred_len, sample_count, quantiles)
        if not isinstance(df_list, (list, tuple)) or not df_list:
            raise ValueError("df_list must be a non-empty list of DataFrames")
        if not (len(df_list) == len(x_timestamp_list) == len(y_timestamp_list)):
            raise ValueError(f"df_list, x_timestamp_list and y_timestamp_list have different lengths: "
                             f"{len(df_list)}, {len(x_timestamp_list)}, {len(y_timestamp_list)}")
        xs, means, stds, x_stamps, y_stamps, y_indexes = [], [], [], [], [], []
        for i, (df, x_ts, y_ts) in enumerate(zip(df_list, x_timestamp_list, y_timestamp_list)):
            name = "df" if len(df_list) == 1 else f"df_list[{i}]"
            x = candle_matrix(df, name)
            x_idx, y_idx = to_datetime_index(x_ts, "x_timestamp"), to_datetime_index(y_ts, "y_timestamp")
            if len(x_idx) != len(x):
                raise ValueError(f"x_timestamp has {len(x_idx)} entries but {name} has {len(x)} rows")
            if len(y_idx) != pred_len:
                raise ValueError(f"y_timestamp has {len(y_idx)} entries but pred_len is {pred_len}")
            check_increasing(x_idx, "x_timestamp")
            check_increasing(y_idx, "y_timestamp")
            if x_idx[-1] >= y_idx[0]:
                raise ValueError(f"y_timestamp must start after the context: first forecast time {y_idx[0]} is not "
                                 f"after the last context time {x_idx[-1]}")
            xn, mean, std = normalize(x, self.clip)
            xs.append(xn), means.append(mean), stds.append(std), y_indexes.append(y_idx)
            x_stamps.append(calc_time_stamps(x_idx).to_numpy(np.float32))
            y_stamps.append(calc_time_stamps(y_idx).to_numpy(np.float32))
        lengths = {len(x) for x in xs}
        if len(lengths) > 1:
            raise ValueError(f"predict_batch needs series of equal length, got context lengths {sorted(lengths)}")

        paths = self.generate(np.stack(xs), np.stack(x_stamps), np.stack(y_stamps), pred_len, T, top_k, top_p,
                              sample_count, verbose)  # (B, S, pred_len, 6), normalised
        results = []
        for i, y_idx in enumerate(y_indexes):
            scale = stds[i] + 1e-5
            # Average in normalised space, then undo the normalisation (the published order: same float32 bits).
            mean_df = pd.DataFrame(paths[i].mean(axis=0) * scale + means[i], columns=FEATURE_COLS, index=y_idx)
            samples = paths[i] * scale + means[i]  # (S, pred_len, 6) in input units
            if not (return_samples or quantiles):
                results.append(mean_df)
                continue
            qs = {q: pd.DataFrame(np.quantile(samples, q, axis=0), columns=FEATURE_COLS, index=y_idx)
                  for q in (quantiles or [])}
            results.append(Forecast(mean_df, samples, qs))
        return results

    @torch.inference_mode()
    def generate(self, x: np.ndarray, x_stamp: np.ndarray, y_stamp: np.ndarray, pred_len: int, T: float = 1.0,
                 top_k: int | None = 0, top_p: float | None = 0.9, sample_count: int = 1,
                 verbose: bool = False) -> np.ndarray:
        """Normalised context x (B, N, 6) + stamps (B, N, 5), (B, pred_len, 5) -> sample paths (B, S, pred_len, 6).

        Each series is repeated `sample_count` times, its context encoded in full, `pred_len` token pairs sampled
        with a predictor window of `max_context`, and the last `max_context` tokens decoded.
        """
        dev = self.device
        b, n, d = x.shape
        s = sample_count
        rep = lambda a, dtype: torch.tensor(np.asarray(a), dtype=dtype, device=dev).repeat_interleave(s, dim=0)
        x_t = torch.clip(rep(x, torch.float32), -self.clip, self.clip)  # (B*S, N, 6)
        stamps = torch.cat([rep(x_stamp, torch.long), rep(y_stamp, torch.long)], dim=1)  # (B*S, N + pred_len, 5)
        s1_ctx, s2_ctx = self.tokenizer.encode(x_t, half=True)
        s1, s2 = generate_tokens(self.model, s1_ctx, s2_ctx, stamps, pred_len, self.max_context, T, top_k, top_p,
                                 use_cache=self.use_cache, verbose=verbose)
        start = max(0, n + pred_len - self.max_context)
        z = self.tokenizer.decode((s1[:, start:], s2[:, start:]), half=True)  # (B*S, window, 6)
        return z[:, -pred_len:].float().cpu().numpy().reshape(b, s, pred_len, d)

    @staticmethod
    def _check_options(pred_len, sample_count, quantiles) -> None:
        if not isinstance(pred_len, (int, np.integer)) or pred_len < 1:
            raise ValueError(f"pred_len must be an integer >= 1, got {pred_len!r}")
        if not isinstance(sample_count, (int, np.integer)) or sample_count < 1:
            raise ValueError(f"sample_count must be an integer >= 1, got {sample_count!r}")
        for q in quantiles or []:
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"quantiles must lie in [0, 1], got {q}")
