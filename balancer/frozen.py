"""The one pydantic ``model_config`` of every config model in the package: frozen (a config is a
value: hashable, never changed in place) and ``extra="forbid"`` (a typo in a YAML file or a
keyword is an error naming the key, never a silent default). ``FROZEN_FINITE`` also refuses
inf and NaN floats (cost coefficients, hardware figures)."""
from __future__ import annotations

from pydantic import ConfigDict

FROZEN = ConfigDict(frozen=True, extra="forbid")
FROZEN_FINITE = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
