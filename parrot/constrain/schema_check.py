r"""Checking a JSON output against the whole JSON schema the request sent.

Real-world schemas hold keywords no grammar enforces (``uniqueItems``, ``not``, ``if``/``then``,
``propertyNames``, vendor ``format``s); llguidance compiles the rest in its lenient mode and names
what it left out. Every finished output is then checked against the full schema by a JSON Schema
validator (the draft the schema's ``$schema`` names, 2020-12 when none; ``format`` checked where
the validator knows the format), so the client learns whether its answer validated. A ``$ref``
outside the schema is never fetched: it makes the check fail with the reason.

Patterns (``pattern``, ``patternProperties``, a schema's ``regex`` format) are read by the
``regex`` module rather than Python's ``re``: JSON Schema patterns are ECMA-262 regular
expressions, and real-world schemas use its Unicode property classes (``\p{L}``, ``\p{Lu}``,
``\p{Z}``), which ``re`` rejects (the schema was refused as invalid) and ``regex`` reads as
ECMA-262 does; the grammar engine enforces them too.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import regex
from jsonschema.exceptions import ValidationError
from referencing import Registry

_NO_REMOTE: Registry[Any] = Registry()  # an empty registry: remote $refs are unresolvable, not fetched


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict[str, Any]) -> Any:
    if validator.is_type(instance, "string") and not regex.search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: dict[str, Any]) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            if regex.search(pattern, name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _with_regex(cls: Any) -> tuple[Any, jsonschema.FormatChecker]:
    """``cls`` reading patterns with ``regex``, and its format checker with ``regex`` format so."""
    checker = jsonschema.FormatChecker()
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    checker.checks("regex", raises=regex.error)(lambda text: not isinstance(text, str) or regex.compile(text))
    extended = jsonschema.validators.extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties})
    return extended, checker


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
        cls, formats = _with_regex(cls)
        meta = jsonschema.validators.validator_for(cls.META_SCHEMA, default=cls)
        error = jsonschema.exceptions.best_match(
            _with_regex(meta)[0](cls.META_SCHEMA, format_checker=formats).iter_errors(schema))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            raise ValueError(f"the schema is invalid at {where}: {error.message}") from None
        self.validator = cls(schema, registry=_NO_REMOTE, format_checker=formats)

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
