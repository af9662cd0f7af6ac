"""Constrained-decoding cases for the end-to-end tests: plain schemas, regexes and choices as users
write them (written once, not tuned to what the bundled model does), each with its check."""

from __future__ import annotations

import json
import re

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = [
    ("Describe a person.", PERSON),
    ("Give a product with a price.", {"type": "object", "properties": {"product": {"type": "string"},
                                      "price": {"type": "number"}, "in_stock": {"type": "boolean"}},
                                      "required": ["product", "price", "in_stock"]}),
    ("List three colors.", {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"},
                            "minItems": 3, "maxItems": 3}}, "required": ["colors"]}),
    ("What is the weather like?", {"type": "object", "properties": {"city": {"type": "string"},
                                   "sky": {"enum": ["sunny", "cloudy", "rainy"]}, "celsius": {"type": "integer"}},
                                   "required": ["city", "sky", "celsius"]}),
    ("Rate this movie from 1 to 5.", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1,
                                      "maximum": 5}}, "required": ["stars"]}),
    ("Give a book and its author.", {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": {"type": "string"}, "author": {"type": "string"}}, "required": ["title", "author"]}},
        "required": ["book"]}),
    ("Is water wet? Answer with a boolean.", {"type": "boolean"}),
    ("How many legs does a spider have?", {"type": "integer"}),
    ("Give two cities with their countries.", {"type": "array", "items": {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city", "country"]},
        "minItems": 2, "maxItems": 2}),
    ("Make a todo item.", {"type": "object", "properties": {"task": {"type": "string"},
                           "done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}},
                           "required": ["task", "done", "priority"]}),
    ("Give a date.", {"type": "object", "properties": {"year": {"type": "integer"}, "month": {"type": "integer",
                      "minimum": 1, "maximum": 12}, "day": {"type": "integer", "minimum": 1, "maximum": 31}},
                      "required": ["year", "month", "day"]}),
    ("Name an animal and whether it can fly.", {"type": "object", "properties": {"animal": {"type": "string"},
                                                "flies": {"type": "boolean"}}, "required": ["animal", "flies"]}),
]
REGEXES = [
    ("Give a phone number.", r"\d{3}-\d{3}-\d{4}"),
    ("What time is it?", r"([01]\d|2[0-3]):[0-5]\d"),
    ("Give an email address.", r"[a-z]{3,10}@[a-z]{3,10}\.(com|org)"),
    ("Write a date.", r"\d{4}-\d{2}-\d{2}"),
    ("Answer yes or no: is the sun hot?", r"(yes|no)"),
    ("Give a hex color.", r"#[0-9a-f]{6}"),
    ("Name a fruit in capitals.", r"[A-Z]{3,12}"),
    ("Give a version number.", r"v\d\.\d{1,2}\.\d{1,2}"),
]
CHOICES = [
    ("What color is the sky?", ["blue", "green", "red"]),
    ("Is Paris in France?", ["yes", "no"]),
]


def cases() -> list[tuple[str, dict, callable]]:
    """(prompt, structured_outputs spec, check(text) -> bool), every kind."""
    out = []
    for prompt, schema in SCHEMAS:
        out.append((prompt, {"json": schema}, lambda text, schema=schema: matches_schema(text, schema)))
    for prompt, pattern in REGEXES:
        out.append((prompt, {"regex": pattern}, lambda text, pattern=pattern: re.fullmatch(pattern, text) is not None))
    for prompt, options in CHOICES:
        out.append((prompt, {"choice": options}, lambda text, options=options: text in options))
    out.append(("Give a JSON object about a dog.", {"json_object": True},
                lambda text: isinstance(_loads(text), dict)))
    return out


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def matches_schema(text: str, schema: dict) -> bool:
    """Validation of the subset of JSON schema the cases use (type, properties, required,
    additionalProperties false, enum, minimum/maximum, items, minItems/maxItems)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return _valid(value, schema)


def _valid(value, schema: dict) -> bool:
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    if kind is not None and not checks[kind](value):
        return False
    if "minimum" in schema and value < schema["minimum"] or "maximum" in schema and value > schema["maximum"]:
        return False
    if kind == "object":
        props = schema.get("properties", {})
        if any(key not in value for key in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(_valid(value[k], props[k]) for k in value if k in props)
    if kind == "array":
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            return False
        return all(_valid(v, schema.get("items", {})) for v in value)
    return True
