"""Tools for a chat: read and check a tools file (OpenAI-style function specs), and find the calls
in a reply written in Qwen3.5's format, the one its template teaches:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A VALUE is text; the template writes objects and lists as JSON, so a parameter the tool's schema
does not declare as a string is read back as JSON where it parses. Nothing here runs a tool.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.safe_files import check_names, read_json, short

_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _function(spec: dict) -> dict:
    return spec.get("function", spec) if spec.get("type") == "function" else spec


def check_tools(tools, origin: str = "tools") -> list[dict]:
    """A list of function specs ({"type": "function", "function": {"name", ...}} or the bare
    function), or a one-line error naming what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise UserError(f"{origin}: expected a non-empty JSON list of function specs, e.g. "
                        '[{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}]')
    for i, spec in enumerate(tools):
        fn = _function(spec) if isinstance(spec, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise UserError(f"{origin}: entry {i} is not a function spec (it needs a \"name\"); give "
                            '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise UserError(f"{origin}: entry {i} ({fn['name']}): \"parameters\" must be a JSON schema object")
    return tools


TOOLS_BYTES = 1 << 20  # a tools file: function specs, a few KB each


def read_tools(path) -> list[dict]:
    """--tools FILE: a regular file of at most TOOLS_BYTES, JSON nested at most JSON_DEPTH deep."""
    path = Path(path)
    check_names(path, "--tools")
    data = read_json(path, TOOLS_BYTES, "--tools file", "give a JSON file with a list of function specs")
    return check_tools(data, f"--tools {short(path)}")


def _string_params(tools: list[dict] | None, name: str) -> set[str]:
    for spec in tools or []:
        fn = _function(spec)
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


def _value(text: str, as_string: bool):
    if as_string:
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # model output nested past Python's recursion limit stays text
        return text


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """(the reply's text before its first call, stripped; the calls as {"name", "arguments"})."""
    calls = []
    for match in _CALL.finditer(text):
        name = match.group(1).strip()
        strings = _string_params(tools, name)
        args = {k.strip(): _value(v, k.strip() in strings) for k, v in _PARAM.findall(match.group(2))}
        calls.append({"name": name, "arguments": args})
    content = text[: text.find("<tool_call>")] if calls else text
    return content.split("</think>")[-1].strip(), calls
