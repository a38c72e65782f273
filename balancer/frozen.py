"""The one pydantic ``model_config`` of every config model in the package: frozen (a config is a
value: hashable, never changed in place) and ``extra="forbid"`` (a typo in a YAML file or a
keyword is an error naming the key, never a silent default). ``FROZEN_FINITE`` also refuses
inf and NaN floats (cost coefficients, hardware figures)."""
from __future__ import annotations

import types
import typing

from pydantic import BaseModel, ConfigDict, model_validator

FROZEN = ConfigDict(frozen=True, extra="forbid")
FROZEN_FINITE = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _numeric(annotation) -> bool:
    """Whether a field's annotation is a number (int / float, optional or in a union) and not
    also a bool (a field typed ``bool`` or ``Union[bool, int]`` keeps its booleans)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (
        typing.Union, types.UnionType) else (annotation,)
    return bool not in args and any(a in (int, float) for a in args)


class NoBoolNumbers(BaseModel):
    """A config model whose number fields refuse booleans (pydantic's lax mode reads
    ``dp: true`` as 1 and ``seed: false`` as 0): the error names the field."""

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data):
        if isinstance(data, dict):
            for k, v in data.items():
                f = cls.model_fields.get(k)
                if isinstance(v, bool) and f is not None and _numeric(f.annotation):
                    raise ValueError(f"{k}: {v} is a boolean, expected a number")
        return data
