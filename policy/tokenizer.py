"""An offline-built byte-level BPE tokenizer with a chat template that renders tools.

No downloads: the tokenizer is trained in-process on a corpus the caller supplies (for the
quickstart, rendered conversations of the task), with digits split one per token so numbers copy
cleanly. Any byte string stays encodable (byte-level). The chat template follows the ChatML /
Hermes tool-calling layout that Hugging Face and TRL understand:

    <|im_start|>system
    # Tools
    calculate(expression: string) - Evaluate an arithmetic expression.
      expression: Numbers with + - * / and parentheses, e.g. "(12 + 7) * 3".
    To call a tool, reply with <tool_call>...<|im_end|>
    <|im_start|>user
    question<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "calculate", "arguments": {"expression": "2 + 2"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    4
    </tool_response><|im_end|>
    <|im_start|>assistant
    4<|im_end|>
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS_TURN, EOS_TURN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SPECIAL_TOKENS = [PAD, BOS_TURN, EOS_TURN, *TOOL_TOKENS]

# Tools are rendered as compact signatures (name, typed parameters, descriptions) rather than
# raw JSON schemas: a few dozen tokens instead of a few hundred, in every sequence.
_TOOLS = (
    "{{- '# Tools' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}"
    "{%- set props = f.parameters.properties if f.parameters is defined else {} %}"
    "{%- set required = f.parameters.required if f.parameters is defined else [] %}"
    "{{- '\\n' + f.name + '(' }}"
    "{%- for name, p in props.items() %}"
    "{{- name + ': ' + (p.type if p.type is string else p.type | join('|')) }}"
    "{%- if name not in (required or []) %}{{- '?' }}{%- endif %}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ') - ' + (f.description or '') }}"
    "{%- for name, p in props.items() %}"
    "{%- if p.description %}{{- '\\n  ' + name + ': ' + p.description }}{%- endif %}"
    "{%- if p.enum %}{{- ' (one of ' + p.enum | join(', ') + ')' }}{%- endif %}"
    "{%- endfor %}"
    "{%- endfor %}"
)

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    + _TOOLS
    + "{{- '\\nTo call a tool, reply with <tool_call>\\n"
    '{"name": <tool-name>, "arguments": <json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{%- set args = tc.function.arguments %}"
    '{{- \'<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{{- (args if args is string else args | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(corpus: Iterable[str], *, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` (deterministic for the same corpus and size)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TURN,
        pad_token=PAD,
        additional_special_tokens=[BOS_TURN, *TOOL_TOKENS],
        padding_side="left",
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def render_conversations(conversations: Iterable[tuple[list[dict], list[dict]]]) -> list[str]:
    """Render (messages, tools) pairs with CHAT_TEMPLATE (a tokenizer corpus before a tokenizer
    exists)."""
    bootstrap = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    bootstrap.chat_template = CHAT_TEMPLATE
    return [
        bootstrap.apply_chat_template(messages, tools=tools or None, tokenize=False)
        for messages, tools in conversations
    ]
