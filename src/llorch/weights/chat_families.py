"""Chat templates for models that ship none: the turn format of the model's family.

A GGUF file or Hugging Face directory without a chat template still belongs to a
family whose turn markers its tokenizer carries (Gemma's <start_of_turn>, Llama 3's
header tokens, ChatML's <|im_start|>, Mistral's [INST]). The family is read from the
architecture and confirmed by the vocabulary, so a template is never chosen whose
markers the tokenizer would split into pieces. A model of no known family gets a
plain "User:/Assistant:" transcript. These templates know the roles system, user and
assistant; tools and tool results reach them already written as text (tool_prompt.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GEMMA = """{{ bos_token }}
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}
{%- for message in messages if message['role'] != 'system' -%}
<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}
{% if loop.first and system %}{{ system }}

{% endif %}{{ message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif -%}"""

LLAMA3 = """{{ bos_token }}
{%- for message in messages -%}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{%- endfor -%}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif -%}"""

CHATML = """{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""

MISTRAL = """{{ bos_token }}
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}
{%- for message in messages if message['role'] != 'system' -%}
{%- if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}
{%- else %}[INST] {% if loop.first and system %}{{ system }}

{% endif %}{{ message['content'] }} [/INST]
{%- endif -%}
{%- endfor -%}"""

PLAIN = """{%- for message in messages -%}
{{ message['role'] | capitalize }}: {{ message['content'] }}

{% endfor -%}
{%- if add_generation_prompt %}Assistant:{% endif -%}"""


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    markers: tuple[str, ...]  # tokens the vocabulary must hold for the template to apply
    template: str


FAMILIES = (
    Family("gemma", ("gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n"), ("<start_of_turn>", "<end_of_turn>"),
           GEMMA),
    Family("llama3", ("llama",), ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), LLAMA3),
    Family("chatml", ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "llama", "mistral"), ("<|im_start|>", "<|im_end|>"),
           CHATML),
    Family("mistral", ("llama", "mistral"), ("[INST]", "[/INST]"), MISTRAL),
)
PLAIN_FAMILY = Family("plain", (), (), PLAIN)


def family_for(architecture: str, has_token: Callable[[str], bool]) -> Family:
    """The family whose architecture matches and whose turn markers are single tokens of the vocabulary
    (`has_token`); failing that, any family whose markers are; failing that, the plain transcript."""
    fits = [f for f in FAMILIES if all(has_token(marker) for marker in f.markers)]
    for family in fits:
        if architecture.lower() in family.architectures:
            return family
    return fits[0] if fits else PLAIN_FAMILY
