"""Count, on any OpenAI-compatible server, the JSON-schema answers that run away (cut by ``max_tokens``) and
those that stop but do not parse or do not match their schema.

Usage (one server at a time, on 127.0.0.1; counting, not timing, so the machine's load does not matter):

    pagoda serve --port 8000 &
    python contrib/structured-outputs/schema_runaways.py --base-url http://127.0.0.1:8000/v1
    python contrib/structured-outputs/schema_runaways.py --base-url http://127.0.0.1:8001/v1 --label vLLM

The 100 requests: the 50 schemas of ``tests/structured_schemas.py`` (every string, number and array bounded),
and the same 50 with every bound removed (no ``maxLength``, ``maximum``, ``maxItems``, ``pattern``, ``format``),
each sent as ``response_format`` ``json_schema`` on ``/chat/completions`` with the chat prompt of that file,
``max_tokens`` 128, at temperature 0 and at temperature 1 (seed = the request's index). It prints one Markdown
row per temperature: runaways, answers that stopped but are not JSON or break their schema, output tokens.
``--show`` prints each runaway and each invalid answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from structured_schemas import MAX_TOKENS, SCHEMAS, prompt_for, validator  # noqa: E402

BOUNDS = ("maxLength", "maximum", "exclusiveMaximum", "maxItems", "pattern", "format")


def unbounded(schema: Any) -> Any:
    """``schema`` with every upper bound, pattern and format removed (at any depth, ``properties`` names kept)."""
    if isinstance(schema, list):
        return [unbounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: ({name: unbounded(s) for name, s in v.items()} if k in ("properties", "$defs") else unbounded(v))
            for k, v in schema.items() if k not in BOUNDS or k in ("properties", "$defs")}


def requests() -> list[tuple[str, dict[str, Any]]]:
    """The 100 (description, schema) pairs: the bounded 50, then the same 50 unbounded."""
    return list(SCHEMAS) + [(d, unbounded(s)) for d, s in SCHEMAS]


def one(client: openai.OpenAI, model: str, index: int, description: str, schema: dict, temperature: float):
    response = client.chat.completions.create(
        model=model, messages=prompt_for(description), max_tokens=MAX_TOKENS, temperature=temperature,
        seed=index, response_format={"type": "json_schema",
                                     "json_schema": {"name": f"schema{index}", "schema": schema}})
    choice = response.choices[0]
    return choice.finish_reason, choice.message.content or "", response.usage.completion_tokens


def run(client: openai.OpenAI, model: str, temperature: float, concurrency: int, show: bool) -> dict[str, int]:
    cases = requests()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda a: one(client, model, a[0], *a[1], temperature), enumerate(cases)))
    runaways = invalid = tokens = 0
    for (description, schema), (finish, text, n) in zip(cases, results, strict=True):
        tokens += n
        if finish == "length":
            runaways += 1
            if show:
                print(f"  runaway ({description}): {text!r}", file=sys.stderr)
            continue
        try:
            validator(schema).validate(json.loads(text))
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid += 1
            if show:
                print(f"  invalid ({description}): {text!r}: {str(exc).splitlines()[0]}", file=sys.stderr)
    return {"runaways": runaways, "invalid": invalid, "tokens": tokens, "requests": len(cases)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="the model name to send (default: the server's first in /models)")
    parser.add_argument("--label", default="", help="the first column of the printed rows (default: the model)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--show", action="store_true", help="print each runaway and invalid answer to stderr")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="none", timeout=600)
    model = args.model or client.models.list().data[0].id
    print("| server | temperature | cut by max_tokens | stopped, not JSON or not its schema | output tokens |")
    print("|---|---|---|---|---|")
    for temperature in args.temperatures:
        r = run(client, model, temperature, args.concurrency, args.show)
        print(f"| {args.label or model} | {temperature:g} | {r['runaways']} of {r['requests']} | "
              f"{r['invalid']} | {r['tokens']:,} |", flush=True)


if __name__ == "__main__":
    main()
