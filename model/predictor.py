"""What `KronosPredictor.from_pretrained` reads beside a predictor: `kronos_predictor.json`.

A finetuned predictor folder (the engine's `best_model/`) holds config.json + model.safetensors (published format),
`tokenizer_config.json` (the tokenizer it was trained with, config only) and, when the run wrote it,
`kronos_predictor.json`: {"max_context": int, "tokenizer": folder or Hub id, "clip": float}. A relative
"tokenizer" path is resolved against the predictor folder, so the run folder can be moved as a whole.

Also here:
- KronosPredictor: DataFrame in, forecast DataFrame out (the interface existing Kronos user code calls).
- Long-format forecasting (in the style of Chronos' `predict_df`): one frame with many series, one row per candle.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import pandas as pd
import torch

from model.features import (
    FEATURES,
    PRICE_FEATURES,
    calc_time_stamps,
    candle_matrix,
    check_increasing,
    denormalize,
    normalize,
    to_datetime_index,
)
from model.fileio import read_json_object, write_json
from model.generation import generate_tokens
from model.hub import resolve_model_dir
from model.kronos import Kronos
from model.tokenizer import KronosTokenizer

PREDICTOR_INFO_NAME = "kronos_predictor.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
DEFAULT_MAX_CONTEXT = 512  # the window of the published Kronos-small / Kronos-base


def write_predictor_info(folder: str | os.PathLike, *, max_context: int, tokenizer: str | os.PathLike | None = None,
                         clip: float | None = None) -> Path:
    """Write `kronos_predictor.json` into a predictor folder (atomically).

    Parameters
    ----------
    folder: the predictor folder (e.g. a stage's best_model/).
    max_context: the predictor window used in training (lookback + predict) - what forecasting should use.
    tokenizer: the tokenizer the predictor was trained with (folder or Hub id). A folder is stored relative to
        `folder` when it lies under the same parent tree, so moving the run keeps it valid.
    clip: the normalisation clip used in training.

    Returns
    -------
    The written file's path.
    """
    return write_json(Path(folder) / PREDICTOR_INFO_NAME,
                      predictor_info(folder, max_context=max_context, tokenizer=tokenizer, clip=clip))


def predictor_info(folder: str | os.PathLike, *, max_context: int, tokenizer: str | os.PathLike | None = None,
                   clip: float | None = None) -> dict[str, Any]:
    """The content of `kronos_predictor.json` for a predictor that will live in `folder` (arguments as in
    `write_predictor_info`); a tokenizer folder is made relative to `folder`."""
    if not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 1:
        raise ValueError(f"max_context must be an integer >= 1, got {max_context!r}")
    folder = Path(folder)
    info: dict[str, Any] = {"max_context": max_context}
    if tokenizer is not None:
        tok = Path(tokenizer)
        if tok.exists():
            try:
                tokenizer = os.path.relpath(tok.resolve(), folder.resolve())
            except ValueError:  # another drive (Windows): keep it absolute
                tokenizer = str(tok.resolve())
        info["tokenizer"] = str(tokenizer)
    if clip is not None:
        info["clip"] = float(clip)
    return info


def read_predictor_info(folder: Path) -> dict[str, Any]:
    """`kronos_predictor.json` checked ({} when absent): max_context int >= 1, tokenizer str, clip > 0."""
    path = folder / PREDICTOR_INFO_NAME
    if not path.is_file():
        return {}
    info = read_json_object(path)
    mc = info.get("max_context")
    if mc is not None and (not isinstance(mc, int) or isinstance(mc, bool) or not 1 <= mc <= 1_000_000):
        raise ValueError(f"{path}: max_context must be an integer in [1, 1000000], got {mc!r}")
    if "tokenizer" in info and not isinstance(info["tokenizer"], str):
        raise ValueError(f"{path}: tokenizer must be a folder path or Hub id (a string), got {info['tokenizer']!r}")
    clip = info.get("clip")
    if clip is not None and (not isinstance(clip, (int, float)) or isinstance(clip, bool) or not clip > 0):
        raise ValueError(f"{path}: clip must be a number > 0, got {clip!r}")
    return info


def tokenizer_source(folder: Path, info: dict[str, Any]) -> str | None:
    """The tokenizer recorded in `info` as a loadable source (relative folders resolved against `folder`)."""
    tok = info.get("tokenizer")
    if tok is None:
        return None
    candidate = folder / tok
    return str(candidate) if candidate.is_dir() else tok


def read_tokenizer_config(folder: Path) -> dict[str, Any] | None:
    """The predictor folder's `tokenizer_config.json` (the tokenizer it was trained with), or None."""
    path = folder / TOKENIZER_CONFIG_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


@dataclass
class Forecast:
    """A forecast with its sample paths, all in the input's units and indexed by the forecast timestamps."""

    mean: pd.DataFrame
    """(pred_len, 6) mean over the sample paths, columns FEATURES."""
    samples: np.ndarray
    """(S, pred_len, 6) the sample paths."""
    quantiles: dict[float, pd.DataFrame] = field(default_factory=dict)
    """{q: (pred_len, 6) DataFrame} per requested quantile."""


def default_device() -> str:
    """cuda:0, else mps, else cpu."""
    if torch.cuda.is_available():
        return "cuda:0"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


class KronosPredictor:
    """Forecast candles with a Kronos predictor and its tokenizer.

    Parameters
    ----------
    model, tokenizer: a matching pair (same s1/s2 bits).
    device: where to run; None = `default_device()`.
    max_context: the predictor's window (512 for Kronos-small/base; lookback + predict for a finetuned one).
    clip: normalised values are clipped to [-clip, clip].
    use_cache: True = key/value-cached generation; False = the plain full-recompute generator (same tokens, slower).
    """

    def __init__(self, model: Kronos, tokenizer: KronosTokenizer, device: str | None = None,
                 max_context: int = DEFAULT_MAX_CONTEXT, clip: float = 5, use_cache: bool = True):
        if (tokenizer.s1_bits, tokenizer.s2_bits) != (model.s1_bits, model.s2_bits):
            raise ValueError(f"the tokenizer has s1/s2 bits {tokenizer.s1_bits}/{tokenizer.s2_bits} but the "
                             f"predictor expects {model.s1_bits}/{model.s2_bits}; use a matching pair")
        if not isinstance(max_context, (int, np.integer)) or max_context < 1:
            raise ValueError(f"max_context must be an integer >= 1, got {max_context!r}")
        self.device = torch.device(device or default_device())
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer.to(self.device).eval()
        self.max_context = int(max_context)
        self.clip = clip
        self.use_cache = use_cache

    # ----------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, folder_or_id: str | os.PathLike, *, tokenizer: str | os.PathLike | KronosTokenizer |
                        None = None, device: str | None = None, max_context: int | None = None,
                        clip: float | None = None, use_cache: bool = True, **hub_kwargs: Any) -> KronosPredictor:
        """Load a predictor, its tokenizer and its window.

        Parameters
        ----------
        folder_or_id: a predictor folder (e.g. a finetuned run's predictor best_model/) or Hub id.
        tokenizer: folder, Hub id or a loaded KronosTokenizer. None = the "tokenizer" recorded in the folder's
            kronos_predictor.json (written by the engine); without one this is an error (for the published pair
            pass e.g. tokenizer="NeoQuasar/Kronos-Tokenizer-base").
        device: as in the constructor.
        max_context: None = kronos_predictor.json's max_context, else 512 (the published Kronos-small/base window).
        clip: None = kronos_predictor.json's clip, else 5.
        hub_kwargs: cache_dir, revision, token, local_files_only, force_download (for both downloads).

        Returns
        -------
        A KronosPredictor. When the folder holds tokenizer_config.json, the tokenizer's config must equal it
        (ValueError otherwise: the pair would not match what the predictor was trained with).
        """
        allowed = {"cache_dir", "revision", "token", "local_files_only", "force_download"}
        unknown = sorted(set(hub_kwargs) - allowed)
        if unknown:
            raise TypeError(f"unexpected arguments {unknown}; Hub options are {sorted(allowed)}")
        folder = resolve_model_dir(folder_or_id, allow_patterns=["*.json", "model.safetensors"], **hub_kwargs)
        info = read_predictor_info(folder)
        model = Kronos.from_pretrained(folder)
        if tokenizer is None:
            tokenizer = tokenizer_source(folder, info)
            if tokenizer is None:
                raise ValueError(f"{folder} records no tokenizer ({PREDICTOR_INFO_NAME} with a 'tokenizer' entry); "
                                 "pass tokenizer= a tokenizer folder or Hub id, e.g. the tokenizer stage's "
                                 "best_model/ or 'NeoQuasar/Kronos-Tokenizer-base'")
        if not isinstance(tokenizer, KronosTokenizer):
            tokenizer = KronosTokenizer.from_pretrained(tokenizer, **hub_kwargs)
        expected = read_tokenizer_config(folder)
        if expected is not None and expected != tokenizer.config:
            diff = sorted(k for k in set(expected) | set(tokenizer.config)
                          if expected.get(k) != tokenizer.config.get(k))
            raise ValueError(f"the tokenizer does not match {Path(folder) / TOKENIZER_CONFIG_NAME} (the one the "
                             f"predictor was trained with): {diff} differ; pass the matching tokenizer=")
        return cls(model, tokenizer, device=device,
                   max_context=max_context if max_context is not None else info.get("max_context",
                                                                                    DEFAULT_MAX_CONTEXT),
                   clip=clip if clip is not None else info.get("clip", 5), use_cache=use_cache)

    # ------------------------------------------------------------ public
    @overload
    def predict(self, df: pd.DataFrame, x_timestamp: Any, y_timestamp: Any, pred_len: int, T: float = ...,
                top_k: int | None = ..., top_p: float | None = ..., sample_count: int = ..., verbose: bool = ...,
                return_samples: Literal[False] = ..., quantiles: None = ...) -> pd.DataFrame: ...

    @overload
    def predict(self, df: pd.DataFrame, x_timestamp: Any, y_timestamp: Any, pred_len: int, T: float = ...,
                top_k: int | None = ..., top_p: float | None = ..., sample_count: int = ..., verbose: bool = ...,
                return_samples: bool = ..., quantiles: Sequence[float] | None = ...) -> Forecast: ...

    def predict(self, df, x_timestamp, y_timestamp, pred_len, T=1.0, top_k=0, top_p=0.9, sample_count=1,
                verbose=True, return_samples=False, quantiles=None):
        """Forecast `pred_len` candles after `df`.

        Parameters
        ----------
        df: context candles, N rows; open/high/low/close required, volume/amount optional (filled, see
            `features.candle_matrix`).
        x_timestamp: N datetimes of the context; y_timestamp: pred_len datetimes of the forecast.
        pred_len: steps to forecast.
        T, top_k, top_p: sampling temperature and filters (top_k=1 is greedy; None disables a filter).
        sample_count: sample paths averaged into the mean.
        verbose: progress bar.
        return_samples, quantiles: ask for a `Forecast` (paths and/or quantile frames) instead of a DataFrame.

        Returns
        -------
        DataFrame (pred_len, 6), columns FEATURES, indexed by y_timestamp, the mean over the paths - when
        return_samples is False and quantiles is None; otherwise a `Forecast`.
        """
        out = self.predict_batch([df], [x_timestamp], [y_timestamp], pred_len, T, top_k, top_p, sample_count,
                                 verbose, return_samples, quantiles)
        return out[0]

    @overload
    def predict_batch(self, df_list: Sequence[pd.DataFrame], x_timestamp_list: Sequence[Any],
                      y_timestamp_list: Sequence[Any], pred_len: int, T: float = ..., top_k: int | None = ...,
                      top_p: float | None = ..., sample_count: int = ..., verbose: bool = ...,
                      return_samples: Literal[False] = ..., quantiles: None = ...) -> list[pd.DataFrame]: ...

    @overload
    def predict_batch(self, df_list: Sequence[pd.DataFrame], x_timestamp_list: Sequence[Any],
                      y_timestamp_list: Sequence[Any], pred_len: int, T: float = ..., top_k: int | None = ...,
                      top_p: float | None = ..., sample_count: int = ..., verbose: bool = ...,
                      return_samples: bool = ..., quantiles: Sequence[float] | None = ...) -> list[Forecast]: ...

    def predict_batch(self, df_list, x_timestamp_list, y_timestamp_list, pred_len, T=1.0, top_k=0, top_p=0.9,
                      sample_count=1, verbose=True, return_samples=False, quantiles=None):
        """Forecast several series; arguments as `predict`, one entry per series in each list.

        Series may have different context lengths: they are batched in groups of equal length (in greedy mode the
        results equal calling `predict` one by one). Returns a list in the input order, of DataFrames or of
        `Forecast`s as `predict` does.
        """
        self._check_options(pred_len, sample_count, quantiles)
        if not isinstance(df_list, (list, tuple)) or not df_list:
            raise ValueError("df_list must be a non-empty list of DataFrames")
        if not (len(df_list) == len(x_timestamp_list) == len(y_timestamp_list)):
            raise ValueError(f"df_list, x_timestamp_list and y_timestamp_list have different lengths: "
                             f"{len(df_list)}, {len(x_timestamp_list)}, {len(y_timestamp_list)}")
        prepared = [self._prepare(df, x_ts, y_ts, pred_len, "df" if len(df_list) == 1 else f"df_list[{i}]")
                    for i, (df, x_ts, y_ts) in enumerate(zip(df_list, x_timestamp_list, y_timestamp_list))]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(prepared):
            groups[len(p["x"])].append(i)
        paths: list[np.ndarray | None] = [None] * len(prepared)
        for members in groups.values():
            out = self.generate(np.stack([prepared[i]["x"] for i in members]),
                                np.stack([prepared[i]["x_stamp"] for i in members]),
                                np.stack([prepared[i]["y_stamp"] for i in members]), pred_len, T, top_k, top_p,
                                sample_count, verbose)  # (G, S, pred_len, 6), normalised
            for j, i in enumerate(members):
                paths[i] = out[j]
        return [self._result(p, path, return_samples, quantiles) for p, path in zip(prepared, paths)]

    def predict_df(self, df: pd.DataFrame, *, prediction_length: int, id_column: str = "id",
                   timestamp_column: str = "timestamps", freq: str | None = None, quantiles: Sequence[float] = (),
                   T: float = 1.0, top_k: int | None = 0, top_p: float | None = 0.9, sample_count: int = 1,
                   verbose: bool = False) -> pd.DataFrame:
        """Forecast every series of a long frame (see `model.predictor.predict_df`, which documents it)."""
        from model.predictor import predict_df
        return predict_df(self, df, prediction_length=prediction_length, id_column=id_column,
                          timestamp_column=timestamp_column, freq=freq, quantiles=quantiles, T=T, top_k=top_k,
                          top_p=top_p, sample_count=sample_count, verbose=verbose)

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

    # ----------------------------------------------------------- helpers
    def _prepare(self, df: pd.DataFrame, x_ts: Any, y_ts: Any, pred_len: int, name: str) -> dict[str, Any]:
        """Check one series and normalise it: x (N, 6), mean/std (1, 6), x_stamp (N, 5), y_stamp (pred_len, 5)."""
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
        xn, mean, std = normalize(x, self.clip, axis=0)
        return {"x": xn, "mean": mean, "std": std, "y_index": y_idx,
                "x_stamp": calc_time_stamps(x_idx).to_numpy(np.float32),
                "y_stamp": calc_time_stamps(y_idx).to_numpy(np.float32)}

    @staticmethod
    def _result(p: dict[str, Any], paths: np.ndarray, return_samples: bool,
                quantiles: Sequence[float] | None) -> pd.DataFrame | Forecast:
        """Normalised paths (S, pred_len, 6) -> the mean DataFrame, or a Forecast, in input units."""
        cols, y_idx = list(FEATURES), p["y_index"]
        # Average in normalised space, then undo the normalisation (the published order: same float32 bits).
        mean_df = pd.DataFrame(denormalize(paths.mean(axis=0), p["mean"], p["std"]), columns=cols, index=y_idx)
        if not (return_samples or quantiles):
            return mean_df
        samples = denormalize(paths, p["mean"], p["std"])  # (S, pred_len, 6)
        qs = {q: pd.DataFrame(np.quantile(samples, q, axis=0), columns=cols, index=y_idx) for q in (quantiles or [])}
        return Forecast(mean_df, samples, qs)

    @staticmethod
    def _check_options(pred_len: int, sample_count: int, quantiles: Sequence[float] | None) -> None:
        if not isinstance(pred_len, (int, np.integer)) or isinstance(pred_len, bool) or pred_len < 1:
            raise ValueError(f"pred_len must be an integer >= 1, got {pred_len!r}")
        if not isinstance(sample_count, (int, np.integer)) or isinstance(sample_count, bool) or sample_count < 1:
            raise ValueError(f"sample_count must be an integer >= 1, got {sample_count!r}")
        for q in quantiles or []:
            if not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
                raise ValueError(f"quantiles must lie in [0, 1], got {q!r}")


if TYPE_CHECKING:
    from model.predictor import KronosPredictor


def future_timestamps(timestamps: pd.DatetimeIndex, prediction_length: int, freq: str | None,
                      series: object) -> pd.DatetimeIndex:
    """The `prediction_length` timestamps after `timestamps`, at `freq` or the series' inferred frequency."""
    if freq is None:
        if len(timestamps) < 3:
            raise ValueError(f"series {series!r} has {len(timestamps)} rows: too few to infer its frequency; pass "
                             "freq= (e.g. freq='5min')")
        with warnings.catch_warnings():  # pandas 3 warns that infer_freq will return an offset; both work below
            warnings.simplefilter("ignore")
            freq = pd.infer_freq(timestamps)
        if freq is None:
            raise ValueError(f"series {series!r}: cannot infer a regular frequency from its timestamps (gaps such as "
                             "market closes?); pass freq= (e.g. freq='5min' or freq='B')")
    try:
        offset = pd.tseries.frequencies.to_offset(freq)
    except ValueError:
        raise ValueError(f"freq {freq!r} is not a pandas frequency string (e.g. '5min', 'h', 'D', 'B')") from None
    return pd.date_range(timestamps[-1] + offset, periods=prediction_length, freq=offset)


def predict_df(predictor: KronosPredictor, df: pd.DataFrame, *, prediction_length: int, id_column: str = "id",
               timestamp_column: str = "timestamps", freq: str | None = None, quantiles: Sequence[float] = (),
               T: float = 1.0, top_k: int | None = 0, top_p: float | None = 0.9, sample_count: int = 1,
               verbose: bool = False) -> pd.DataFrame:
    """Forecast every series of a long frame.

    Parameters
    ----------
    predictor: the KronosPredictor.
    df: long frame, one row per candle: `id_column`, `timestamp_column` (datetimes), open/high/low/close
        (+ volume/amount). Rows are sorted by timestamp within each series; series may differ in length.
    prediction_length: steps to forecast per series.
    freq: pandas frequency of the forecast timestamps; None = infer each series' own (`pd.infer_freq`).
    quantiles: quantile levels in [0, 1] to add as `{feature}_{q}` columns (from `sample_count` paths).
    T, top_k, top_p, sample_count, verbose: as in `KronosPredictor.predict`.

    Returns
    -------
    DataFrame with prediction_length rows per series (series in order of first appearance): id_column,
    timestamp_column, FEATURES (mean forecast), then the quantile columns.
    """
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"df must be a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in (id_column, timestamp_column, *PRICE_FEATURES) if c not in df.columns]
    if missing:
        raise ValueError(f"df is missing columns {missing} (id_column={id_column!r}, "
                         f"timestamp_column={timestamp_column!r}, prices {list(PRICE_FEATURES)})")
    if len(df) == 0:
        raise ValueError("df is empty: no series to forecast")
    if df[id_column].isna().any():
        raise ValueError(f"column {id_column!r} has missing ids; every row must belong to a series")
    quantiles = list(quantiles)
    ids, frames, x_ts, y_ts = [], [], [], []
    for sid, part in df.groupby(id_column, sort=False):
        part = part.sort_values(timestamp_column, kind="stable")
        ts = part[timestamp_column]
        if not pd.api.types.is_datetime64_any_dtype(ts):
            raise ValueError(f"column {timestamp_column!r} must hold datetimes (dtype {ts.dtype}); convert it with "
                             "pd.to_datetime first")
        index = pd.DatetimeIndex(ts)
        ids.append(sid)
        frames.append(part[[c for c in FEATURES if c in part.columns]].reset_index(drop=True))
        x_ts.append(index)
        y_ts.append(future_timestamps(index, prediction_length, freq, sid))
    results = predictor.predict_batch(frames, x_ts, y_ts, prediction_length, T, top_k, top_p, sample_count, verbose,
                                      False, quantiles or None)
    out = []
    for sid, y, res in zip(ids, y_ts, results):
        mean = res.mean if quantiles else res
        part = pd.DataFrame({id_column: [sid] * prediction_length, timestamp_column: y})
        part[list(FEATURES)] = mean.to_numpy()
        for q in quantiles:
            part[[f"{f}_{q}" for f in FEATURES]] = res.quantiles[q].to_numpy()
        out.append(part)
    return pd.concat(out, ignore_index=True)
