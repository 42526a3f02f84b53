"""What every backend reads of a request's :class:`StructuredOutputsParams`: which field it is, its JSON
schema, the key the compile cache files it under."""

from __future__ import annotations

import json
from typing import Any

from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import StructuredOutputsParams

# the schema of ``json_object``: any JSON object
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def kind_of(spec: StructuredOutputsParams) -> str:
    """The constraint's field: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
    if spec.json is not None:
        return "json"
    if spec.json_object:
        return "json_object"
    return next(name for name in ("regex", "choice", "grammar") if getattr(spec, name) is not None)


def param_of(spec: StructuredOutputsParams) -> str:
    """The request field to name in an error about the constraint."""
    return f"structured_outputs.{kind_of(spec)}"


def schema_of(spec: StructuredOutputsParams) -> dict[str, Any]:
    """The JSON schema of a ``json`` or ``json_object`` constraint, parsed; InvalidRequestError if its text is
    not a JSON object."""
    if spec.json_object:
        return ANY_OBJECT_SCHEMA
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"structured_outputs.json is not valid JSON ({exc}); send a JSON schema "
                                      "object", param="structured_outputs.json") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"structured_outputs.json must be a JSON schema object, not "
                                  f"{type(schema).__name__}", param="structured_outputs.json")
    return schema


def check_schema(spec: StructuredOutputsParams) -> None:
    """InvalidRequestError saying where and how a ``json`` constraint breaks the JSON Schema specification (its
    ``$schema`` draft, 2020-12 if it names none)."""
    import jsonschema

    schema = schema_of(spec)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "/".join(str(p) for p in error.path)
        raise InvalidRequestError(f"{param_of(spec)} is not a valid JSON schema: at {where or 'its top'}: "
                                  f"{error.message}", param=param_of(spec))
    _check_references(schema, param_of(spec))


# the keyword whose subschemas a value must all meet, with no output of their own between (anyOf and oneOf
# may offer another way out)
_SAME_VALUE_KEYWORDS = ("allOf",)


def _check_references(schema: dict[str, Any], param: str) -> None:
    """InvalidRequestError for a ``$ref`` outside the schema (a URL: the server fetches nothing), one that
    points nowhere, or a chain of references that comes back to where it started before any output (``{"$ref":
    "#"}``: no JSON value meets it)."""
    for node in _dicts(schema):
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
            raise InvalidRequestError(f"{param} refers to {str(ref)[:100]!r}: only references inside the schema "
                                      "('#', '#/$defs/name') are followed; put the referenced schema in $defs",
                                      param=param)
    for node in _dicts(schema):
        seen: list[int] = []
        pending = [node]
        while pending:
            current = pending.pop()
            if id(current) in seen:
                if current is node:
                    raise InvalidRequestError(
                        f"{param} refers to itself with no output in between (through $ref"
                        f"{' and allOf' if len(seen) > 1 else ''}), so no JSON value meets it; a "
                        "recursive schema must nest (a property or an array item refers back)", param=param)
                continue
            seen.append(id(current))
            if "$ref" in current:
                pending.append(_resolve(schema, current["$ref"], param))
            for keyword in _SAME_VALUE_KEYWORDS:
                pending += [sub for sub in current.get(keyword) or () if isinstance(sub, dict)]


def _resolve(schema: dict[str, Any], ref: str, param: str) -> Any:
    """The subschema a ``#/a/b`` reference points at (JSON pointer escapes read)."""
    node: Any = schema
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise InvalidRequestError(f"{param} refers to {ref[:100]!r}, which is not in the schema; references "
                                      "are JSON pointers from the schema's top, e.g. '#/$defs/name'", param=param)
    if not isinstance(node, dict):
        raise InvalidRequestError(f"{param} refers to {ref[:100]!r}, which is not a schema object", param=param)
    return node


def _dicts(node: Any):
    """Every dict inside ``node``, depth first."""
    pending = [node]
    while pending:
        current = pending.pop()
        if isinstance(current, dict):
            yield current
            pending += current.values()
        elif isinstance(current, list):
            pending += current


def cache_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """``(field, canonical text)``: equal for constraints that compile alike (a schema's key order ignored)."""
    kind = kind_of(spec)
    if kind in ("json", "json_object"):
        return kind, json.dumps(schema_of(spec), sort_keys=True)
    if kind == "choice":
        return kind, json.dumps(list(spec.choice))
    return kind, getattr(spec, kind)


def is_ebnf(grammar: str) -> bool:
    """Whether a grammar is written in EBNF/GBNF (``rule ::= ...``) rather than Lark (``rule: ...``)."""
    return "::=" in grammar
