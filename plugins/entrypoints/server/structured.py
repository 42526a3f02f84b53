"""Structured outputs over HTTP: OpenAI's ``response_format`` (chat), vLLM's ``structured_outputs`` field and
its older ``guided_*`` fields, all turned into one :class:`StructuredOutputsParams`."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from pagoda.errors import InvalidRequestError
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.request_body import (MAX_CHOICES, MAX_ID_CHARS, MAX_NAME_CHARS, RequestBody,
                                                            UnusableJSON, list_bound, load_json_text)
from pagoda.sampling_params import StructuredOutputsParams

JSONSchema = Union[str, dict[str, Any]]
Choices = Annotated[list[str], list_bound(MAX_CHOICES, min_items=1)]
Backend = Annotated[str, Field(max_length=MAX_ID_CHARS)]


class JSONSchemaFormat(RequestBody):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: Annotated[str, Field(max_length=MAX_NAME_CHARS)] = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(RequestBody):
    """``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class StructuredOutputsField(RequestBody):
    """vLLM's ``structured_outputs`` request field: exactly one of json, json_object, regex, choice, grammar."""

    json_: Optional[JSONSchema] = Field(None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[Choices] = None
    grammar: Optional[str] = None
    backend: Optional[Backend] = None


class StructuredOutputFields(RequestBody):
    """The request fields that constrain the output, shared by completions and chat completions."""

    structured_outputs: Optional[StructuredOutputsField] = None
    # vLLM's older names of the same constraints
    guided_json: Optional[JSONSchema] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[Choices] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[Backend] = None


def structured_outputs_of(body: Any) -> tuple[Optional[StructuredOutputsParams], str]:
    """The request's constraint and the field it came from (named in errors); 400 when it has more than one."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt: Optional[ResponseFormat] = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema, e.g. "
                                '{"type": "json_schema", "json_schema": {"name": "answer", "schema": {...}}}',
                           param="response_format.json_schema.schema")
        found.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
    so = body.structured_outputs
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("json_object", so.json_object or None), ("regex", so.regex),
                                    ("choice", so.choice), ("grammar", so.grammar)) if v is not None}
        field = f"structured_outputs.{next(iter(given))}" if len(given) == 1 else "structured_outputs"
        found.append((field, given))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None, ""
    if len(found) > 1:
        raise APIError(400, "the output can follow one constraint, and this request has "
                            + ", ".join(name for name, _ in found) + "; send only one of them",
                       param=found[1][0])
    field, values = found[0]
    schema_text = values.get("json")
    if isinstance(schema_text, str):
        try:
            load_json_text(schema_text)
        except UnusableJSON as exc:
            raise APIError(400, f"the JSON schema in {field} {exc}; send a schema the engine can compile",
                           param=field) from None
        except ValueError:
            pass  # not JSON: the engine's check says so in its words
    backend = (so.backend if so is not None else None) or body.guided_decoding_backend
    try:
        return StructuredOutputsParams(**values, backend=backend), field
    except InvalidRequestError as exc:
        raise APIError(400, _renamed(str(exc), exc.param, field), param=field) from None


async def check_compiles(engine: Any, spec: Optional[StructuredOutputsParams], field: str, request: Any = None,
                         owner: Optional[str] = None) -> None:
    """400 naming the request's own field when the constraint does not compile (or not in time). The compile
    runs in the engine's compile pool, in ``owner``'s turn; the engine then finds it cached. With ``request``,
    a client that disconnects meanwhile gives up its wait (a compile nobody waits for is stopped)."""
    if spec is None:
        return
    from pagoda.plugins.entrypoints.server.serving import unless_disconnected  # serving imports this module

    try:
        waiting = asyncio.wrap_future(engine.engine.structured_outputs.compile(spec, owner))
        await (waiting if request is None else unless_disconnected(request, waiting))
    except InvalidRequestError as exc:
        param = field if exc.param != "structured_outputs.backend" else exc.param
        raise APIError(400, _renamed(str(exc), exc.param, param), param=param) from None


def _renamed(message: str, param: Optional[str], field: str) -> str:
    """An engine message about ``structured_outputs.<x>`` told in the request's own field name."""
    if param and param != field and param.startswith("structured_outputs"):
        return message.replace(param, field)
    return message
