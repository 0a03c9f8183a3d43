"""metrics.jsonl records as strict JSON, both ways (torch-free: the launcher reads them too)."""

from __future__ import annotations

import json
import math
from typing import Any

# A NaN or infinity is not JSON (json.dumps writes a bare NaN): a record carries it as one of these strings,
# which float() also reads, and `decode_record` turns back into the float.
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _finite_or_name(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite_or_name(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_name(v) for v in value]
    return value


def encode_record(record: dict[str, Any]) -> str:
    """One metrics.jsonl line, strict JSON: non-finite floats as "NaN" / "Infinity" / "-Infinity"."""
    plain = json.loads(json.dumps(record, default=float))  # tensors, numpy scalars -> float first
    return json.dumps(_finite_or_name(plain), allow_nan=False)


def decode_record(line: str) -> Any:
    """A metrics.jsonl line back as written: the non-finite names of its top-level values as floats.
    Raises ValueError (json.JSONDecodeError) on a line that is not JSON."""
    rec = json.loads(line)
    if isinstance(rec, dict):
        return {k: NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in rec.items()}
    return rec
