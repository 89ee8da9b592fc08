"""Checking a JSON output against the whole JSON schema the request sent.

Real-world schemas hold keywords no grammar enforces (``uniqueItems``, ``not``, ``if``/``then``,
``propertyNames``, vendor ``format``s); llguidance compiles the rest in its lenient mode and names
what it left out. Every finished output is then checked against the full schema by a JSON Schema
validator (the draft the schema's ``$schema`` names, 2020-12 when none; ``format`` checked where
the validator knows the format), so the client learns whether its answer validated. A ``$ref``
outside the schema is never fetched: it makes the check fail with the reason.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from referencing import Registry

_NO_REMOTE: Registry[Any] = Registry()  # an empty registry: remote $refs are unresolvable, not fetched


class SchemaCheck:
    """A validator of one schema; ``SchemaCheck(schema)`` raises ValueError for an invalid schema."""

    def __init__(self, schema: dict[str, Any] | str) -> None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the schema is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object, not {type(schema).__name__}")
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            raise ValueError(f"the schema is invalid at {where}: {exc.message}") from None
        self.validator = cls(schema, registry=_NO_REMOTE, format_checker=cls.FORMAT_CHECKER)

    def check(self, text: str) -> str | None:
        """None when ``text`` is JSON valid against the schema, else the first reason it is not."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc}"
        try:
            error = jsonschema.exceptions.best_match(self.validator.iter_errors(value))
        except Exception as exc:  # an unresolvable $ref, a pattern Python's re cannot read, ...
            return f"the validator could not check it: {type(exc).__name__}: {exc}"
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return f"at {where}: {error.message}"
