"""The family's tokenizer: byte-level BPE trained locally on the prepared JSONL corpus.

Byte-level (GPT-2 style, no prefix space, no normalizer; digits split one per token), so every
string, including code with tabs and any Unicode, round-trips exactly: ``decode(encode(x)) == x``.
Four special tokens come first,
ids 0-3: ``<|endoftext|>`` (bos = eos = pad = unk; documents are separated by it, the datamodule
appends it), ``<|system|>``, ``<|user|>``, ``<|assistant|>``. The chat template renders

    <|system|>\\n{content}<|endoftext|>\\n<|user|>\\n{content}<|endoftext|>\\n<|assistant|>\\n

(the last part only with ``add_generation_prompt=True``), so a reply ends at ``<|endoftext|>``.
With ``tools`` it first lists them in a system turn and asks for calls in the Hermes format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, which serve/tools.py parses); an
assistant's ``tool_calls`` are rendered in that format, and a ``tool`` message as a user turn in
``<tool_response>`` tags. Saved in Hugging Face format (``tokenizer.json``, ``tokenizer_config.json``, ...): any tool reads
it with ``AutoTokenizer.from_pretrained(dir)``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOT = "<|endoftext|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [EOT, *ROLE_TOKENS.values()]

CHAT_TEMPLATE = (
    # with tools: a system turn listing them (the system message's content first), in the Hermes format
    # that serve/tools.py parses: a call is <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    "{%- if tools %}"
    "{{- '<|system|>\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call these functions (their arguments are JSON Schemas):\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call one, answer <tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call>." + EOT
    + "\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- elif message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>" + EOT + "\\n' }}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '" + EOT + "\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)


def iter_texts(files: Iterable[str | Path]) -> Iterator[str]:
    """Yield the ``text`` field of every record of the given JSONL files, streaming line by line."""
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)["text"]


def train_tokenizer(
    files: list[Path],
    vocab_size: int,
    out_dir: Path,
    *,
    model_max_length: int = 512,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on JSONL ``text`` fields and save it to ``out_dir``.

    Args:
        files: JSONL files (``{"text": ...}`` per line), e.g. ``[data/general/train.jsonl]``.
        vocab_size: total vocabulary including the 256 byte symbols and the 4 special tokens; the
            result has exactly this many entries unless the corpus runs out of merges first.
        out_dir: Hugging Face tokenizer folder. A new folder is written to a temp folder next to
            it and renamed into place; into an existing folder (e.g. a model checkpoint) the files
            are moved one by one with ``os.replace``, leaving its other files alone.
        model_max_length: recorded in ``tokenizer_config.json`` (tokens; the model's context).

    Returns:
        The tokenizer as reloaded from ``out_dir`` with ``AutoTokenizer`` (a
        ``PreTrainedTokenizerFast``): bos/eos/pad/unk ``<|endoftext|>`` (id 0), the role tokens
        (ids 1-3) as extra special tokens, and the chat template.

    Raises:
        FileNotFoundError: a corpus file is missing (run ``make data``).
        ValueError: ``vocab_size`` cannot hold the byte alphabet and the special tokens, or the
            corpus is empty.
    """
    files = [Path(f) for f in files]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found: run `make data` first")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} < {len(alphabet) + len(SPECIAL_TOKENS)} "
                         "(256 byte symbols + special tokens)")

    tok = Tokenizer(models.BPE())
    # Digits become one token each (as in LLaMA): a tiny model learns column arithmetic far more
    # easily than with GPT-2's arbitrary multi-digit chunks. Still lossless.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=alphabet, min_frequency=2, show_progress=False)
    tok.train_from_iterator(iter_texts(files), trainer=trainer)
    if tok.get_vocab_size() <= len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"no merges learned: is the corpus {[str(f) for f in files]} empty?")

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT, eos_token=EOT, pad_token=EOT, unk_token=EOT,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,   # exact round-trip: never rewrite " ." and friends
        chat_template=CHAT_TEMPLATE,
    )
    save_atomic(wrapped, Path(out_dir))
    return AutoTokenizer.from_pretrained(out_dir)


def save_atomic(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """``save_pretrained`` into a temp folder beside ``out_dir``, then rename it into place (new
    folder) or ``os.replace`` each file into it (existing folder, e.g. a model checkpoint)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    os.chmod(tmp, 0o755)   # mkdtemp makes it 0700; the renamed folder should read like any other
    try:
        tokenizer.save_pretrained(tmp)
        if not out_dir.exists():
            try:
                os.rename(tmp, out_dir)
                return
            except OSError:          # created meanwhile by someone else: fall through and merge
                pass
        for f in sorted(tmp.iterdir()):
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
