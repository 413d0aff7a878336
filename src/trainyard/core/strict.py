"""The base of every params section (trainyard.core.config, config_serving)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # forbid: an unknown key is a typo until proven otherwise; frozen: params are read once
    # and handed on, never changed on the way.
    model_config = ConfigDict(extra="forbid", frozen=True)
