"""How tool calls are written in the model's text, and how a chat template without tool support
gets tools and tool traffic (``tool_messages``).

Format (Hermes / Qwen2.5 style, what chat templates with tool support mostly use): each call is a
compact JSON object, name first, in tags, calls one per line::

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

``tool_messages``: the tool prompt joins the system message, an assistant's calls become the
tagged blocks above, and a ``tool`` message becomes a user message in ``<tool_response>`` tags.
The grammar of a call and reading calls back are in :mod:`parrot.constrain.tools`.
"""

from __future__ import annotations

import json
from typing import Any

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
OPEN = OPEN_TAG + "\n"
CLOSE = "\n" + CLOSE_TAG

TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system prompt part that describes ``tools`` (OpenAI tool objects)."""
    return TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` (with OpenAI's ``tool_calls`` and ``tool`` roles) as plain role/content
    messages, with the tool prompt (when ``tools``) at the end of the system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + calls)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tool_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": tool_prompt(tools)})
    return out


def call_text(name: str, arguments: str) -> str:
    """One call in the output format (``arguments``: a JSON text, as OpenAI sends it)."""
    return f'{OPEN}{{"name":{json.dumps(name)},"arguments":{arguments}}}{CLOSE}'
