"""Test helper: a JSON answer checked against OpenAI's published schema, as the `openai` package
types it (generated from OpenAI's OpenAPI document: openai.types.Completion, Model,
responses.Response, responses.ResponseStreamEvent, ...).

Those types accept any extra field (the SDK must survive new ones), so validating is not enough:
`conform` also walks the parsed value and fails on every field the schema does not define, except
those the caller allows by name (vLLM's additions, such as a model card's `root`). Imported by name
(`from published_schema import conform`), like live_server.py.
"""

from __future__ import annotations

import pydantic


def conform(type_, data, allowed_extras: dict[str, set[str]] | None = None):
    """`data` parsed as `type_` (a pydantic model or any type pydantic validates: an annotated
    union); raises pydantic.ValidationError for a missing or mistyped field, AssertionError for a
    field `type_` does not define unless `allowed_extras[class name]` holds it."""
    parsed = pydantic.TypeAdapter(type_).validate_python(data)
    allowed = allowed_extras or {}
    extras = [(path, key) for path, cls, key in extra_fields(parsed, "$")
              if key not in allowed.get(cls, set())]
    assert not extras, f"fields the published schema does not define: {extras}"
    return parsed


def extra_fields(value, path: str) -> list[tuple[str, str, str]]:
    """(where, class name, field) for every field beyond its model's schema in a parsed value."""
    if isinstance(value, pydantic.BaseModel):
        found = [(path, type(value).__name__, key) for key in (value.model_extra or {})]
        for name in type(value).model_fields:
            found += extra_fields(getattr(value, name), f"{path}.{name}")
        return found
    if isinstance(value, (list, tuple)):
        found = []
        for i, item in enumerate(value):
            found += extra_fields(item, f"{path}[{i}]")
        return found
    if isinstance(value, dict):
        found = []
        for key, item in value.items():
            found += extra_fields(item, f"{path}.{key}")
        return found
    return []
