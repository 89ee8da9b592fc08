"""A second set of real-world JSON schemas, taken from packages the tests install rather than from
``../shared/data``: what users of a structured-output API send when they ask for configuration
files and API objects.

- **Kubernetes** (the ``kubernetes-validate`` package, its newest ``-local`` schema set): one
  schema per API object kind (84 kinds in 1.37), the stable version where there is one, with the
  definitions it reaches bundled under ``$defs`` (the files point at a shared
  ``_definitions.json``). They use ``format: int-or-string``, ``x-kubernetes-*`` keywords,
  nullable types (``["string", "null"]``) and deep nesting.
- **SchemaStore** (the schemas ``check-jsonschema`` vendors, licences in its package): CI and
  configuration files (GitHub workflows and actions, GitLab CI, CircleCI, Azure Pipelines,
  Renovate, Dependabot, docker compose, Read the Docs, ...), draft-07 and 2020-12, up to 2.3 MB.

``python -m loadtests.package_schemas`` prints the count per set; ``package_schemas()`` gives the
rows (``id``, ``subset``, ``schema``) in the shape of ``schemas.jsonl``'s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

_REF = re.compile(r"^/api/_definitions\.json#/\$defs/(.+)$")


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


def _rewrite(node: Any, reached: set[str]) -> Any:
    """``node`` with its references to the shared definitions made local; names them in ``reached``."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and (m := _REF.match(value) or re.match(r"^#/\$defs/(.+)$", value)):
                reached.add(m.group(1))
                out[key] = f"#/$defs/{m.group(1)}"
            else:
                out[key] = _rewrite(value, reached)
        return out
    if isinstance(node, list):
        return [_rewrite(v, reached) for v in node]
    return node


def kubernetes_schemas() -> list[dict[str, Any]]:
    base = _package_dir("kubernetes_validate")
    if base is None:
        return []
    root = base / "kubernetes-json-schema"
    versions = sorted((d for d in os.listdir(root) if d.endswith("-local")),
                      key=lambda d: tuple(int(x) for x in d[1:].split("-")[0].split(".")))
    directory = root / versions[-1]
    definitions = json.loads((directory / "_definitions.json").read_text())["$defs"]
    kinds: dict[str, list[str]] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("_") or name == "all.json" or not name.endswith(".json"):
            continue
        properties = json.loads((directory / name).read_text()).get("properties", {})
        kind = (properties.get("kind") or {}).get("enum", [None])[0]
        if "apiVersion" in properties and kind and not kind.endswith("List"):
            kinds.setdefault(kind, []).append(name)
    rows = []
    for kind, names in sorted(kinds.items()):
        name = min(names, key=lambda n: (2 * ("alpha" in n) + ("beta" in n), n))  # the stable version first
        reached: set[str] = set()
        schema = _rewrite(json.loads((directory / name).read_text()), reached)
        bundled: dict[str, Any] = {}
        while pending := sorted(reached - set(bundled)):
            for key in pending:
                bundled[key] = _rewrite(definitions[key], reached)
        schema["$defs"] = bundled
        rows.append({"id": f"kubernetes/{versions[-1]}/{name}", "subset": "kubernetes", "schema": schema})
    return rows


def schemastore_schemas() -> list[dict[str, Any]]:
    base = _package_dir("check_jsonschema")
    if base is None:
        return []
    vendor = base / "builtin_schemas" / "vendor"
    return [{"id": f"schemastore/{path.name}", "subset": "schemastore", "schema": json.loads(path.read_text())}
            for path in sorted(vendor.glob("*.json"))]


def package_schemas() -> list[dict[str, Any]]:
    return kubernetes_schemas() + schemastore_schemas()


if __name__ == "__main__":
    rows = package_schemas()
    for subset in sorted({r["subset"] for r in rows}):
        sizes = [len(json.dumps(r["schema"])) for r in rows if r["subset"] == subset]
        print(f"{subset}: {len(sizes)} schemas, {min(sizes):,}-{max(sizes):,} bytes as JSON")
