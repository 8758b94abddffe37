"""Chat templates in the shape Qwen 2.5, Gemma 3 and Mistral (v3 tokenizer) ship in tokenizer_config.json
(written for these tests), and a tiny tokenizer folder carrying one, as a model folder would."""

import json
from pathlib import Path

from meshlm.data import Tokenizer, load_tokenizer

SHIPPED_CHAT = Path(__file__).parents[2] / "examples" / "chat_small.jsonl"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And twice that?"},
    {"role": "assistant", "content": "Eight, since 2 × 4 = 8."},
]

# ChatML; a conversation without a system message gets a default one.
QWEN = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for turn in messages %}
    {%- if not (loop.first and turn['role'] == 'system') %}
        {{- '<|im_start|>' + turn['role'] + '\n' + turn['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Turns with the assistant named `model`; a system message opens the first turn after it.
GEMMA = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set opening = messages[0]['content'] + '\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set opening = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for turn in turns -%}
    {%- if (turn['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('user and assistant turns must alternate after the system message') }}
    {%- endif -%}
    {{ '<start_of_turn>' + ('model' if turn['role'] == 'assistant' else turn['role']) + '\n' }}
    {{- (opening if loop.first else '') + turn['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

# [INST] ...[/INST] reply</s>; the system prompt goes into the last user turn.
MISTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- for turn in turns %}
    {%- if (turn['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('user and assistant turns must alternate after the system message') }}
    {%- endif %}
    {%- if turn['role'] == 'user' and loop.last and system is defined %}
        {{- '[INST] ' + system + '\n\n' + turn['content'] + '[/INST]' }}
    {%- elif turn['role'] == 'user' %}
        {{- '[INST] ' + turn['content'] + '[/INST]' }}
    {%- else %}
        {{- ' ' + turn['content'] | trim + eos_token }}
    {%- endif %}
{%- endfor %}
"""

# family: (its template, the built-in template of the same format, bos_token, eos_token, end-of-turn stop)
FAMILIES = {
    "qwen": (QWEN, "chatml", None, "<|im_end|>", "<|im_end|>"),
    "gemma": (GEMMA, "gemma", "<bos>", "<eos>", "<end_of_turn>"),
    "mistral": (MISTRAL, "mistral", "<s>", "</s>", "</s>"),
}
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<s>", "</s>"]
SPECIAL_TOKENS += ["[INST]", "[/INST]"]


def family_tokenizers(directory: Path) -> dict[str, Tokenizer]:
    """Per family, a byte-level BPE (fewer than 512 ids: the `test` preset's vocabulary) with the
    families' special tokens, saved in a folder whose tokenizer_config.json holds that family's
    template and special tokens, and loaded back from it."""
    base = load_tokenizer(None, str(SHIPPED_CHAT), 480, cache_dir=directory / "cache")
    base._tok.add_special_tokens(SPECIAL_TOKENS)
    loaded = {}
    for family, (source, _, bos, eos, _) in FAMILIES.items():
        folder = directory / family
        Tokenizer(base._tok, eos_token=base.eos_token).save(folder)
        config = {"eos_token": eos, "chat_template": source} | ({"bos_token": bos} if bos else {})
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        loaded[family] = Tokenizer.from_file(folder)
    return loaded
