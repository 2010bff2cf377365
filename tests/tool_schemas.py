"""A tool the tool-call tests share: its arguments a pydantic model, whose JSON schema keeps the nested
model and the enum in "$defs", referenced as "#/$defs/..." (what clients that build tools with pydantic
send)."""

from __future__ import annotations

import enum
import json

from pydantic import BaseModel, Field

from sluice.engine.structured.tool_calls import Tool


class Unit(enum.StrEnum):
    C = "C"
    F = "F"


def forecast_tool(city_max_length: int) -> Tool:
    """`get_forecast(place: {city, unit}, days)`; a short city keeps a random model's outputs short."""

    class Place(BaseModel):
        city: str = Field(max_length=city_max_length)
        unit: Unit

    class Forecast(BaseModel):
        place: Place
        days: int = Field(ge=1, le=7)

    return Tool("get_forecast", "Forecast for a place", json.dumps(Forecast.model_json_schema()))
