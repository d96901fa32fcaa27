"""`Section`: the base of every run-file section model (rl/config/sections.py, mix.py,
trainer.py): unknown keys refused, values taken as written, errors as ConfigError."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from rl.config.errors import config_error


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True
    )

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc, type(self)) from None

    # Only a direct call comes through here. A section inside another is validated by pydantic
    # without calling __init__ (a custom __init__ would be called, and would translate errors
    # before their key path is complete); this marker is how pydantic's RootModel says so.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @model_validator(mode="before")
    @classmethod
    def _empty_is_default(cls, data: Any) -> Any:
        """A section written with nothing under it (`redis:`) takes its defaults."""
        return {} if data is None else data
