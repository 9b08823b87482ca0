"""metrics.json must be strict JSON (no NaN / Infinity tokens, which many readers reject): convert before dumping."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["strict_json"]


def strict_json(obj):
    """Copy of `obj` that `json.dumps(..., allow_nan=False)` accepts: numpy scalars -> Python, NaN / inf -> None."""
    if isinstance(obj, dict):
        return {str(k): strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return strict_json(obj.tolist())
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj
