"""A validator for the part of JSON Schema (2020-12) that kdash/data/report.schema.json uses.

The project does not depend on `jsonschema`; this covers type, const, enum, properties,
required, additionalProperties, propertyNames, items, minimum, maximum, exclusiveMinimum,
allOf, if/then and local $ref. A keyword it does not know is an error, so the schema cannot
quietly rely on one that is never checked.
"""

from __future__ import annotations

from typing import Any

ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description"}
KNOWN = ANNOTATIONS | {
    "type", "const", "enum", "properties", "required", "additionalProperties", "propertyNames",
    "items", "minimum", "maximum", "exclusiveMinimum", "allOf", "if", "then", "$ref",
}  # fmt: skip


def _is_type(v: Any, t: str) -> bool:
    if t == "null":
        return v is None
    if t == "boolean":
        return isinstance(v, bool)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, int | float) and not isinstance(v, bool)
    if t == "string":
        return isinstance(v, str)
    if t == "array":
        return isinstance(v, list)
    if t == "object":
        return isinstance(v, dict)
    raise ValueError(f"unknown type {t!r}")


def _resolve(root: dict, ref: str) -> dict:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $ref: {ref}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def errors(value: Any, schema: dict, root: dict | None = None, where: str = "$") -> list[str]:
    """Every place where `value` breaks `schema`, as "path: what"."""
    root = schema if root is None else root
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"{where}: keywords this validator does not check: {sorted(unknown)}")
    out: list[str] = []
    if "$ref" in schema:
        out += errors(value, _resolve(root, schema["$ref"]), root, where)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, t) for t in types):
            return out + [f"{where}: {type(value).__name__} is not {'/'.join(types)}"]
    if "const" in schema and value != schema["const"]:
        out.append(f"{where}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not in {schema['enum']}")
    if _is_type(value, "number"):
        out += _number_errors(value, schema, where)
    if isinstance(value, dict):
        out += _object_errors(value, schema, root, where)
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            out += errors(v, schema["items"], root, f"{where}[{i}]")
    for sub in schema.get("allOf", []):
        out += errors(value, sub, root, where)
    if "if" in schema and not errors(value, schema["if"], root, where):
        out += errors(value, schema.get("then", {}), root, where)
    return out


def _number_errors(value: Any, schema: dict, where: str) -> list[str]:
    out: list[str] = []
    if "minimum" in schema and value < schema["minimum"]:
        out.append(f"{where}: {value} < {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        out.append(f"{where}: {value} > {schema['maximum']}")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        out.append(f"{where}: {value} <= {schema['exclusiveMinimum']}")
    return out


def _object_errors(value: dict, schema: dict, root: dict, where: str) -> list[str]:
    out: list[str] = []
    props = schema.get("properties", {})
    for k in schema.get("required", []):
        if k not in value:
            out.append(f"{where}: missing {k!r}")
    for k, v in value.items():
        if "propertyNames" in schema:
            out += errors(k, schema["propertyNames"], root, f"{where}.{k} (name)")
        if k in props:
            out += errors(v, props[k], root, f"{where}.{k}")
        elif schema.get("additionalProperties") is False:
            out.append(f"{where}: unexpected {k!r}")
        elif isinstance(schema.get("additionalProperties"), dict):
            out += errors(v, schema["additionalProperties"], root, f"{where}.{k}")
    return out
