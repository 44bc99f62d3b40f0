#!/usr/bin/env python3
"""Regenerate tests/openai/schema.json from OpenAI's published OpenAPI spec.

    git clone https://github.com/openai/openai-openapi   # file: openapi.yaml (OpenAPI 3.1.0)
    python3 tests/openai/extract_schema.py openai-openapi/openapi.yaml \
        --commit "$(git -C openai-openapi rev-parse HEAD)" > tests/openai/schema.json

Copies the response schemas the conformance check needs, and everything they $ref, from
`components.schemas`, verbatim except that each schema's `x-oaiMeta` (doc-site examples) is
dropped. The `$ref`s stay as `#/components/schemas/X`, so the output keeps the spec's layout
and resolves against its own root. Needs PyYAML.
"""
import argparse
import json
import sys

import yaml

ROOTS = [
    "CreateCompletionResponse",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "ErrorResponse",
    "Error",
]
PREFIX = "#/components/schemas/"


def refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", help="path to openai-openapi's openapi.yaml")
    ap.add_argument("--commit", default="unknown", help="commit of openai/openai-openapi the file is from")
    ap.add_argument("--date", default="", help="that commit's date (for the $comment)")
    args = ap.parse_args()

    with open(args.spec) as f:
        spec = yaml.safe_load(f)
    schemas = spec["components"]["schemas"]

    seen, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for ref in refs(schemas[name]):
            if not ref.startswith(PREFIX):
                sys.exit(f"{name}: unsupported $ref {ref}")
            todo.append(ref[len(PREFIX):])

    out = {
        "$comment": (
            "OpenAI's published API schema, trimmed: the response schemas "
            + ", ".join(ROOTS)
            + " and every schema they $ref, copied verbatim (only x-oaiMeta examples dropped) from "
            "components.schemas of https://github.com/openai/openai-openapi, path openapi.yaml, "
            f"commit {args.commit}{' (' + args.date + ')' if args.date else ''}, "
            f"openapi {spec.get('openapi')}, info.version {spec.get('info', {}).get('version')}. "
            "Regenerate with tests/openai/extract_schema.py. Note: a few stream-chunk fields still use "
            "OpenAPI 3.0's `nullable: true`, which JSON Schema 2020-12 ignores; conformance.py turns "
            "those into anyOf [..., {type: null}] when it loads this file."
        ),
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "components": {
            "schemas": {
                name: {k: v for k, v in schemas[name].items() if k != "x-oaiMeta"}
                for name in sorted(seen)
            }
        },
    }
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
