"""What the tool-calling tests share: the tools, a chat template that shows them to the model, and whether this
pagoda's engine serves structured outputs (``tool_choice`` ``required`` and named functions need them)."""

from __future__ import annotations



WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER_TOOL, ADD_TOOL]

# ChatML, as SmolLM2's own template, plus the Hermes tool format Qwen2.5's template uses: the tools in the system
# turn, an assistant's calls as <tool_call> objects (arguments must be a dict: tojson of a JSON string would
# print an escaped string), each tool result in a tool turn naming the call it answers
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call one or more functions. The functions are:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, answer with a JSON object in <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- set is_text = message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{%- if is_text %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool
{{ {"tool_call_id": message.tool_call_id, "content": message.content} | tojson }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
