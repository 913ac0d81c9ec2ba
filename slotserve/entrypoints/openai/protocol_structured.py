"""The OpenAI API's structured-output and tool-calling fields (and vLLM's `structured_outputs`
extra field), kept apart from protocol.py, which adds them to its requests and responses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slotserve.sampling_params import StructuredOutputsParams


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


# ----------------------------------------------------------------------------- requests

class JsonSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    # `schema` would shadow a BaseModel attribute: the field is named otherwise.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Model):
    """vLLM's `structured_outputs` field (sent through `extra_body`)."""

    json_schema: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_schema, regex=self.regex, choice=self.choice, grammar=self.grammar,
            json_object=self.json_object, disable_any_whitespace=self.disable_any_whitespace)


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class ChatCompletionNamedToolChoiceParam(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


# ----------------------------------------------------------------------------- responses

class FunctionCall(_Model):
    name: str
    # The arguments as JSON text, as the model wrote them (valid against the schema).
    arguments: str


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Model):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
