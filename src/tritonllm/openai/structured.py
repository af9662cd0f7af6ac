"""What an OpenAI request asks the answer to look like, as the models' `structured_outputs` spec
(engine/structured_output.py), and tool calls read back out of a constrained answer.

- `response_format`: `json_object`, or `json_schema` (what the openai SDK's `parse()` sends);
- vLLM's `structured_outputs` field (`json`, `regex`, `choice`, `grammar`, `json_object`), and its
  older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- `tools` with `tool_choice`: `"none"` ignores the tools; a named function constrains the answer to
  that function's parameters; `"required"` to a JSON list of one or more calls `{"name",
  "parameters"}` of the given functions (vLLM's forced path). `"auto"` needs a chat template that
  shows the model its tools and a parser for the model's way of calling them; the bundled model's
  template ignores tools, so `"auto"` is refused with a 400 saying so.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tritonllm.openai.errors import bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class ToolMode:
    """How a constrained answer becomes tool calls: one named function, or a list of calls."""

    named: str | None  # the function's name; None: "required", a list of {"name", "parameters"}


def structured_outputs_of(req) -> dict[str, Any] | None:
    """The spec the request asks for (one at most), or None."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema (an object)",
                                  "response_format")
            asked.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              "response_format")
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", dict(req.structured_outputs)))
    for field, kind in GUIDED.items():
        if getattr(req, field) is not None:
            asked.append((field, {kind: getattr(req, field)}))
    spec = tool_spec(req)
    if spec is not None:
        asked.append(("tool_choice", spec))
    if len(asked) > 1:
        raise bad_request(f"ask for one answer format at a time; this request sets {', '.join(f for f, _ in asked)}",
                          asked[1][0])
    return asked[0][1] if asked else None


def _functions(req) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of the request's tools."""
    functions = {}
    for i, tool in enumerate(req.tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                              "tools")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        functions[function["name"]] = parameters
    return functions


def tool_mode(req) -> ToolMode | None:
    """How the answer is read as tool calls; None: it is plain content."""
    tools = getattr(req, "tools", None)
    if getattr(req, "functions", None):
        raise bad_request("functions (the deprecated form) are not supported; send tools", "functions")
    if not tools:
        if getattr(req, "tool_choice", None) not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    functions = _functions(req)
    if choice == "none":
        return None
    if choice == "required":
        return ToolMode(None)
    if isinstance(choice, dict) and choice.get("type", "function") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                              f"({', '.join(functions)})", "tool_choice")
        return ToolMode(name)
    if choice == "auto":
        raise bad_request("tool_choice 'auto' needs a chat template that shows the model its tools and a parser "
                          "for its tool calls; this model's template ignores tools. Send tool_choice 'required' "
                          "or a named function (the answer is then constrained to the tools' schemas)",
                          "tool_choice")
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", "tool_choice")


def tool_spec(req) -> dict[str, Any] | None:
    mode = tool_mode(req)
    if mode is None:
        return None
    functions = _functions(req)
    if mode.named is not None:
        return {"json": functions[mode.named]}
    call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, parameters in functions.items()]
    return {"json": {"type": "array", "minItems": 1, "items": call[0] if len(call) == 1 else {"anyOf": call}}}


def tool_calls(text: str, mode: ToolMode) -> list[dict[str, Any]] | None:
    """OpenAI's `message.tool_calls` from a constrained answer; None if it is not complete JSON
    (max_tokens cut it off)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = [(mode.named, value)] if mode.named is not None else \
        [(c["name"], c["parameters"]) for c in value if isinstance(c, dict) and "name" in c]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in calls]
