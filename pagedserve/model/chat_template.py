"""The chat template of pagedserve's own checkpoints: Qwen3.5's layout, text only.

It writes exactly what Qwen3.5's published template writes for text messages (images and
videos aside), so that every path the real model takes -- tools in the system turn, calls
in the assistant's turns, tool results, thinking -- runs on the default and test models too::

    <|im_start|>system
    # Tools ... <tools>{tool JSON per line}</tools> ... the call format ... [system text]
    <|im_end|>
    <|im_start|>user\\n{text}<|im_end|>
    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}      (after the
        last user query; earlier turns show only their content)
    <tool_call>\\n<function=NAME>\\n<parameter=P>\\n{value}\\n</parameter>\\n</function>\\n</tool_call>
    <|im_end|>
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>   (one user
        turn holds consecutive tool results)
    <|im_start|>assistant\\n<think>\\n            (generation prompt; with enable_thinking
        false: <think>\\n\\n</think>\\n\\n)

A value that is a mapping or a list is written as JSON, anything else as its string.
"""

from __future__ import annotations

_TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>"
)
_CALL_INSTRUCTIONS = (
    "\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format "
    "with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "<parameter=example_parameter_2>\\nThis is the value for the second parameter\\n"
    "that can span\\nmultiple lines\\n</parameter>\\n</function>\\n</tool_call>\\n\\n"
    "<IMPORTANT>\\nReminder:\\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML "
    "tags\\n- Required parameters MUST be specified\\n- You may provide optional reasoning "
    "for your function call in natural language BEFORE the function call, but NOT after\\n"
    "- If there is no function call available, answer the question like normal with your "
    "current knowledge and do not tell the user about function calls\\n</IMPORTANT>"
)

CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}{{- part.text -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if not messages -%}{{- raise_exception('No messages provided.') -}}{%- endif -%}"
    # The system turn: the tools first, then the system message's text.
    "{%- if tools and tools is iterable and tools is not mapping -%}"
    "{{- '<|im_start|>system\\n' + '" + _TOOLS_PREAMBLE + "' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '" + _CALL_INSTRUCTIONS + "' -}}"
    "{%- if messages[0].role == 'system' -%}"
    "{%- set system = text(messages[0].content) | trim -%}"
    "{%- if system -%}{{- '\\n\\n' + system -}}{%- endif -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + (text(messages[0].content) | trim) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    # The last user query: assistant turns after it show their thinking.
    "{%- set ns = namespace(searching=true, last_query=messages | length - 1) -%}"
    "{%- for message in messages[::-1] -%}"
    "{%- set index = (messages | length - 1) - loop.index0 -%}"
    "{%- if ns.searching and message.role == 'user' -%}"
    "{%- set body = text(message.content) | trim -%}"
    "{%- if not (body.startswith('<tool_response>') and body.endswith('</tool_response>')) -%}"
    "{%- set ns.searching = false -%}{%- set ns.last_query = index -%}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.searching -%}{{- raise_exception('No user query found in messages.') -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set content = text(message.content) | trim -%}"
    "{%- if message.role == 'system' -%}"
    "{%- if not loop.first -%}"
    "{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}"
    "{%- elif message.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if message.reasoning_content is string -%}"
    "{%- set reasoning = message.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- set reasoning = reasoning | trim -%}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{%- if message.tool_calls and message.tool_calls is iterable"
    " and message.tool_calls is not mapping -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- if call.function is defined -%}{%- set call = call.function -%}{%- endif -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}"
    "{%- elif content | trim -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n<function=' + call.name + '>\\n' -}}"
    "{%- if call.arguments is defined -%}"
    "{%- for name, value in call.arguments | items -%}"
    "{{- '<parameter=' + name + '>\\n' -}}"
    "{%- if value is mapping or (value is sequence and value is not string) -%}"
    "{{- value | tojson | safe -}}{%- else -%}{{- value | string -}}{%- endif -%}"
    "{{- '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '</function>\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.previtem and loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- raise_exception('Unexpected message role.') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
