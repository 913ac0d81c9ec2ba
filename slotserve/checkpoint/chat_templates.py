"""Chat templates for files that carry none, in each architecture's known turn format.

Gemma (the format of its instruction-tuned releases, and llama.cpp's built-in `gemma`
template): a system message is folded into the first user turn, the assistant's role is
called `model`, every turn is closed by `<end_of_turn>`.
"""

from __future__ import annotations

from collections.abc import Container

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' "
    "else none -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{%- if loop.first and system %}{{ system | trim + '\\n\\n' }}{% endif -%}"
    "{{ message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif -%}"
)

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)

# GGUF architecture -> (name, template, a token the vocabulary must have for it to apply)
_FALLBACKS = {
    "gemma3": ("gemma", GEMMA_TEMPLATE, "<start_of_turn>"),
    "qwen2": ("chatml", CHATML_TEMPLATE, "<|im_start|>"),
    "qwen3": ("chatml", CHATML_TEMPLATE, "<|im_start|>"),
}


def fallback_chat_template(arch: str, vocab: Container[str]) -> tuple[str, str] | None:
    """(name, template) of the architecture's turn format, if its tokens are in `vocab`."""
    entry = _FALLBACKS.get(arch)
    if entry is None or entry[2] not in vocab:
        return None
    return entry[0], entry[1]
