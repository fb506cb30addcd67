"""The chat template of the built-in model (shared/data/tiny-q8_0.gguf, written there by
tools/train_tiny.py): it renders tools, tool calls, tool results and reasoning the way the
Qwen3.6 template does, shorter: tools as JSON lines in a <tools> block of the system turn; the
Qwen3-Coder XML for calls, string arguments raw and others as JSON; consecutive tool results in
one user turn; reasoning kept only after the last real user message unless preserve_thinking;
`<think>\\n` left open in the generation prompt unless enable_thinking is false; and the
refusals agents trip over (role `developer`, a system message that is not first, no user
message). The tests render with it too, on models of any vocabulary."""
from __future__ import annotations

QWEN_STYLE_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall them as <tool_call><function=NAME><parameter=ARG>' }}
{%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content | trim }}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content | trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' %}
{%- set c = message.content | trim %}
{%- if not (c.startswith('<tool_response>') and c.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for message in messages %}
{%- set content = (message.content or '') | trim %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = (message.reasoning_content if message.reasoning_content is string else '') | trim %}
{%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > ns.last_query_index %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function %}
{{- ('\\n\\n' if loop.first and content else ('' if loop.first else '\\n')) + '<tool_call>\\n<function=' + call.name + '>\\n' }}
{%- for name, value in call.arguments | items %}
{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- raise_exception('Unexpected message role.') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""
