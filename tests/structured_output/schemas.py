"""Random JSON schemas for the structured-output tests: objects (required and optional
properties), arrays, enums, consts, nesting, strings with bounds and patterns, integers and
numbers with bounds, booleans, null and anyOf. Every schema is bounded (strings have a
maxLength, arrays a maxItems, objects no additional properties), so even a model that writes
noise can complete it within a few dozen tokens."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["alpha", "beta", "gamma", "delta", "x", "yy", "Zed", "q-1", "ünï", "日本"]
PATTERNS = [r"^[a-z]{1,5}$", r"^[A-Z][a-z]{0,3}$", r"^[0-9]{2,4}-[a-f]{1,2}$",
            r"^(yes|no|maybe)$"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "const", "null", "pattern"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([0, 1, 9, 500])}
    if kind == "number":
        lo = rng.randint(-50, 50)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        values: list[Any] = rng.sample(WORDS, rng.randint(1, 4))
        if rng.random() < 0.3:
            values.append(rng.randint(-3, 3))
        return {"enum": values}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(["id", "name", "tags", "count", "ok", "when", "Ä", "a b"],
                       rng.randint(1, 4))
    properties = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def random_schemas(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        schema = random_schema(rng)
        if schema.get("type") == "object" or rng.random() < 0.25:  # mostly objects, as APIs
            out.append(schema)
    return out
