"""Fifty JSON schemas of increasing difficulty for the structured-output tests. Every output is bounded:
each string has a maxLength, a pattern or a fixed-length format (date, uuid, ipv4), each array a maxItems,
each object ``additionalProperties: false``, so a complete output fits in ``MAX_TOKENS``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

S = {"type": "string", "maxLength": 10}  # a short free string
NAME = {"type": "string", "minLength": 1, "maxLength": 10}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}

_SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    # 1-10: one field, then a few
    ("a boolean", {"type": "boolean"}),
    ("an integer between 1 and 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("a short name", NAME),
    ("a colour", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("the constant answer", {"const": "forty-two"}),
    ("a person with a name", {"type": "object", "properties": {"name": NAME}, "required": ["name"]}),
    ("a person", {"type": "object", "properties": {"name": NAME, "age": AGE}, "required": ["name", "age"]}),
    ("a switch", {"type": "object", "properties": {"on": {"type": "boolean"}, "level": {"type": "integer",
                  "minimum": 0, "maximum": 9}}, "required": ["on", "level"]}),
    ("a city with a country code", {"type": "object", "properties": {"city": NAME, "country": {
        "type": "string", "enum": ["FR", "DE", "JP", "US"]}}, "required": ["city", "country"]}),
    ("a null", {"type": "null"}),
    # 11-20: arrays and nesting
    ("three small numbers", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                             "minItems": 3, "maxItems": 3}),
    ("one to four tags", {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1,
                          "maxItems": 4}),
    ("a list of colours", {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}),
    ("a person with an address", {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {"street": S, "zip": {
            "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"]}},
        "required": ["name", "address"]}),
    ("a matrix", {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                  "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}),
    ("a team", {"type": "object", "properties": {"team": NAME, "members": {"type": "array", "items": NAME,
                "minItems": 1, "maxItems": 3}}, "required": ["team", "members"]}),
    ("a book", {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1450,
                "maximum": 2030}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                "maxItems": 2}}, "required": ["title", "year", "tags"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                 "y": {"type": "integer", "minimum": -50, "maximum": 50}}, "required": ["x", "y"],
                 "additionalProperties": False}),
    ("nested flags", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]}),
    ("an inventory", {"type": "array", "items": {"type": "object", "properties": {"item": NAME, "count": {
        "type": "integer", "minimum": 0, "maximum": 999}}, "required": ["item", "count"]}, "minItems": 1,
        "maxItems": 3}),
    # 21-30: patterns, formats, number bounds
    ("a product code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}),
    ("a phone number", {"type": "object", "properties": {"phone": {"type": "string",
                        "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}}, "required": ["phone"]}),
    ("a date", {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
                "required": ["day"]}),
    ("an email address", {"type": "object", "properties": {"email": {"type": "string",
                          "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}}, "required": ["email"]}),
    ("an id", {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
               "required": ["id"]}),
    ("an IP address", {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
                       "required": ["ip"]}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                  "verified": {"type": "boolean"}}, "required": ["stars", "verified"]}),
    ("a temperature", {"type": "object", "properties": {"celsius": {"type": "integer", "exclusiveMinimum": -274,
                       "exclusiveMaximum": 100}}, "required": ["celsius"]}),
    ("a hex colour", {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
                      "required": ["hex"]}),
    ("a version", {"type": "object", "properties": {"version": {"type": "string",
                   "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"}, "stable": {"type": "boolean"}},
                   "required": ["version", "stable"]}),
    # 31-40: optional properties, nullable, anyOf, $ref / $defs
    ("a user with an optional nickname", {"type": "object", "properties": {"name": NAME, "nickname": NAME},
                                          "required": ["name"], "additionalProperties": False}),
    ("a nullable note", {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 10}},
                         "required": ["note"]}),
    ("a number or a word", {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 6}]}},
        "required": ["value"]}),
    ("a shape", {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                               "maximum": 9}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
         "required": ["kind", "side"], "additionalProperties": False}]}),
    ("an order with a referenced address", {"$defs": {"address": {"type": "object", "properties": {
        "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
        "type": "object", "properties": {"ship_to": {"$ref": "#/$defs/address"}}, "required": ["ship_to"]}),
    ("two referenced people", {"$defs": {"person": {"type": "object", "properties": {"name": NAME, "age": AGE},
                                                    "required": ["name", "age"]}},
                               "type": "object", "properties": {"a": {"$ref": "#/$defs/person"},
                                                                "b": {"$ref": "#/$defs/person"}},
                               "required": ["a", "b"]}),
    ("a list of referenced items", {"$defs": {"item": {"type": "object", "properties": {"sku": {
        "type": "string", "pattern": "^[A-Z][0-9]{3}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}, "type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1,
        "maxItems": 3}),
    ("a settings object with optional fields", {"type": "object", "properties": {
        "theme": {"enum": ["light", "dark"]}, "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
        "beta": {"type": "boolean"}}, "required": ["theme"], "additionalProperties": False}),
    ("a nullable count", {"type": "object", "properties": {"count": {"anyOf": [{"type": "integer", "minimum": 0,
                          "maximum": 9}, {"type": "null"}]}}, "required": ["count"]}),
    ("an event", {"type": "object", "properties": {"name": NAME, "on": {"type": "string", "format": "date"},
                  "attendees": {"type": "array", "items": {"type": "string", "format": "uuid"},
                                "maxItems": 1}}, "required": ["name", "on", "attendees"]}),
    # 41-50: everything together
    ("a library", {"$defs": {"book": {"type": "object", "properties": {"title": S, "isbn": {
        "type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"}, "available": {"type": "boolean"}},
        "required": ["title", "isbn", "available"]}}, "type": "object", "properties": {
        "name": NAME, "books": {"type": "array", "items": {"$ref": "#/$defs/book"}, "minItems": 1,
                                "maxItems": 2}}, "required": ["name", "books"]}),
    ("a payment", {"type": "object", "properties": {"method": {"anyOf": [
        {"type": "object", "properties": {"card": {"type": "string", "pattern": "^[0-9]{4}$"}},
         "required": ["card"], "additionalProperties": False},
        {"type": "object", "properties": {"iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}},
         "required": ["iban"], "additionalProperties": False}]},
        "cents": {"type": "integer", "minimum": 1, "maximum": 99999}}, "required": ["method", "cents"]}),
    ("a graph", {"type": "object", "properties": {"nodes": {"type": "array", "items": {"type": "string",
                 "pattern": "^[a-e]$"}, "minItems": 2, "maxItems": 4}, "edges": {"type": "array", "items": {
                 "type": "array", "items": {"type": "string", "pattern": "^[a-e]$"}, "minItems": 2,
                 "maxItems": 2}, "maxItems": 3}}, "required": ["nodes", "edges"]}),
    ("a recipe", {"type": "object", "properties": {"dish": NAME, "serves": {"type": "integer", "minimum": 1,
                  "maximum": 12}, "ingredients": {"type": "array", "items": {"type": "object", "properties": {
                      "name": NAME, "grams": {"type": "integer", "minimum": 1, "maximum": 1000}},
                      "required": ["name", "grams"]}, "minItems": 1, "maxItems": 3},
                  "vegan": {"type": "boolean"}}, "required": ["dish", "serves", "ingredients", "vegan"]}),
    ("a log line", {"type": "object", "properties": {"level": {"enum": ["debug", "info", "warn", "error"]},
                    "code": {"type": "string", "pattern": "^E[0-9]{3}$"}, "retry": {"anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]}},
                    "required": ["level", "code", "retry"], "additionalProperties": False}),
    ("a calendar", {"$defs": {"slot": {"type": "object", "properties": {"day": {"type": "string",
                    "format": "date"}, "room": {"enum": ["A", "B"]}}, "required": ["day", "room"]}},
                    "type": "array", "items": {"$ref": "#/$defs/slot"}, "minItems": 1, "maxItems": 2}),
    ("a company", {"$defs": {"person": {"type": "object", "properties": {"name": NAME, "since": {
        "type": "string", "format": "date"}}, "required": ["name", "since"]},
        "dept": {"type": "object", "properties": {"title": NAME, "head": {"$ref": "#/$defs/person"}},
                 "required": ["title", "head"]}}, "type": "object", "properties": {
        "name": NAME, "departments": {"type": "array", "items": {"$ref": "#/$defs/dept"}, "minItems": 1,
                                      "maxItems": 2}}, "required": ["name", "departments"]}),
    ("a form answer", {"type": "object", "properties": {"q1": {"type": "boolean"}, "q2": {"enum": ["a", "b", "c"]},
                       "q3": {"type": "integer", "minimum": 0, "maximum": 10}, "comment": {"type": ["string", "null"],
                                                                                          "maxLength": 12}},
                       "required": ["q1", "q2", "q3"], "additionalProperties": False}),
    ("a weather report", {"type": "object", "properties": {"city": NAME, "days": {"type": "array", "items": {
        "type": "object", "properties": {"date": {"type": "string", "format": "date"}, "high": {
            "type": "integer", "minimum": -40, "maximum": 50}, "sky": {"enum": ["sun", "rain", "snow"]}},
        "required": ["date", "high", "sky"], "additionalProperties": False}, "minItems": 2, "maxItems": 2}},
        "required": ["city", "days"]}),
    ("a network config", {"$defs": {"host": {"type": "object", "properties": {"ip": {"type": "string",
                          "format": "ipv4"}, "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
                          "required": ["ip", "port"], "additionalProperties": False}},
                          "type": "object", "properties": {"primary": {"$ref": "#/$defs/host"}, "backup": {
                              "anyOf": [{"$ref": "#/$defs/host"}, {"type": "null"}]}, "tls": {"type": "boolean"}},
                          "required": ["primary", "backup", "tls"]}),
]

def closed(schema: Any) -> Any:
    """The schema with ``"additionalProperties": false`` on every object that does not say (as OpenAI's strict
    mode asks): an open object lets a model add keys without end."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    result = {k: closed(v) if k in ("properties", "$defs") else closed(v) if isinstance(v, (dict, list)) else v
              for k, v in schema.items()}
    if "properties" in schema:
        result.setdefault("additionalProperties", False)
    return result


SCHEMAS: list[tuple[str, dict[str, Any]]] = [(description, closed(schema)) for description, schema in _SCHEMAS]
MAX_TOKENS = 128  # more than the largest output of these schemas takes (a company: two departments, their heads)
assert len(SCHEMAS) == 50, len(SCHEMAS)


def prompt_for(description: str) -> list[dict[str, str]]:
    """A short chat prompt (the grammar, not the prompt, holds the output to the schema)."""
    return [{"role": "user", "content": f"Answer with JSON only: {description}."}]


def validator(schema: dict):
    """A validator of ``schema`` (its own draft) that checks string formats too."""
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def schema_share(backend: str, speculative: bool) -> list[tuple[int, float]]:
    """The schemas (index into ``SCHEMAS``, temperature) that ``backend`` runs with or without speculation.

    Each backend runs every schema once: xgrammar the even ones without speculation and the odd ones with it,
    guidance the other way round. Within each run half the schemas are greedy and half sampled, at opposite
    temperatures in the two backends. So every schema runs under both backends, greedy and sampled, with and
    without speculation, and each backend meets every (temperature, speculation) pair."""
    first = 0 if (backend == "xgrammar") != speculative else 1
    return [(i, 1.0 if (i % 4 < 2) == (backend == "xgrammar") else 0.0) for i in range(first, len(SCHEMAS), 2)]


def schema_mismatches(outputs, indices=None) -> list[str]:
    """For the outputs of ``SCHEMAS`` (in order, or those at ``indices``): a line for each that did not stop,
    or does not parse and validate against its schema."""
    failures = []
    schemas = SCHEMAS if indices is None else [SCHEMAS[i] for i in indices]
    for (description, schema), out in zip(schemas, outputs, strict=True):
        c = out.outputs[0]
        if c.finish_reason != "stop":
            failures.append(f"{description}: finished by {c.finish_reason} after {len(c.token_ids)} tokens: {c.text!r}")
            continue
        try:
            validator(schema).validate(json.loads(c.text))
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{description}: {c.text!r}: {str(exc).splitlines()[0]}")
    return failures
