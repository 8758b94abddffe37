"""The API's reference page at `/docs`: every route and the fields of its JSON body, rendered on the
server from the app's OpenAPI schema into one HTML page that loads nothing (no script, no stylesheet,
no font, no image: it works offline and its Content-Security-Policy lets the browser fetch nothing).
The machine-readable schema is `/openapi.json`.
"""

from __future__ import annotations

from html import escape
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

STYLE = (
    "body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
    "table{border-collapse:collapse;width:100%}td,th{border:1px solid #ccc;padding:.2rem .5rem;"
    "text-align:left;vertical-align:top}code{font-size:90%}h2{margin-top:2rem}"
)
NOTHING_FETCHED = "default-src 'none'; style-src 'unsafe-inline'"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _type(schema: dict[str, Any]) -> str:
    """A schema as a short phrase: `integer ≥ 0`, `array of string`, `StreamOptions or null`."""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " or ".join(_type(option) for option in schema["anyOf"])
    if "enum" in schema:
        return " | ".join(repr(value) for value in schema["enum"])
    if "const" in schema:
        return repr(schema["const"])
    kind = schema.get("type", "any")
    if kind == "array":
        kind = f"array of {_type(schema.get('items', {}))}"
    bounds = [
        f"{sign} {_number(schema[key])}"
        for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"))
        if key in schema
    ]
    return " ".join([kind, ", ".join(bounds)]).strip()


def _fields(schema: dict[str, Any]) -> str:
    required = set(schema.get("required", ()))
    rows = "".join(
        f"<tr><td><code>{escape(name)}</code>{' (required)' if name in required else ''}</td>"
        f"<td>{escape(_type(field))}</td><td>{escape(repr(field['default'])) if 'default' in field else ''}</td></tr>"
        for name, field in schema.get("properties", {}).items()
    )
    return f"<table><tr><th>field</th><th>type</th><th>default</th></tr>{rows}</table>"


def docs_page(openapi: dict[str, Any]) -> str:
    """The reference page for an OpenAPI schema: each route, then each body schema's fields."""
    info = openapi.get("info", {})
    routes = "".join(
        f"<li><code>{escape(method.upper())} {escape(path)}</code> {escape(operation.get('summary', ''))}"
        + (f" (body: <a href=\"#{escape(body)}\">{escape(body)}</a>)" if (body := _body_name(operation)) else "")
        + "</li>"
        for path, methods in openapi.get("paths", {}).items()
        for method, operation in methods.items()
    )
    schemas = "".join(
        f"<h2 id=\"{escape(name)}\">{escape(name)}</h2>{_fields(schema)}"
        for name, schema in openapi.get("components", {}).get("schemas", {}).items()
        if name not in ("HTTPValidationError", "ValidationError")
    )  # the server answers errors its own way
    return (
        f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(info.get('title', ''))} API"
        f"</title><style>{STYLE}</style></head><body><h1>{escape(info.get('title', ''))} API</h1>"
        f"<p>{escape(info.get('summary', ''))}. The schema as JSON: <a href=\"/openapi.json\">/openapi.json</a>. "
        "Errors are <code>{\"error\": {\"message\", \"type\", \"param\", \"code\"}}</code>.</p>"
        f"<h2>Routes</h2><ul>{routes}</ul>{schemas}</body></html>"
    )


def _body_name(operation: dict[str, Any]) -> str | None:
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    return schema.get("$ref", "").rsplit("/", 1)[-1] or None


def add_docs(app: FastAPI) -> None:
    """`GET /docs`: the reference page of `app` (made with `docs_url=None, redoc_url=None`, whose pages
    would load their scripts and fonts from the internet)."""

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(app.openapi()), headers={"Content-Security-Policy": NOTHING_FETCHED})


__all__ = ["add_docs", "docs_page"]
