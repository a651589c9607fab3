"""Tensor-by-tensor reading of (sharded) Hugging Face safetensors checkpoints with bounded memory.

Why not ``safetensors.safe_open``: it memory-maps each file, and every page a read touches stays
mapped — and counted in the process's resident set — until the file is closed. Streaming a 7B
pair through it shows a resident set that grows to the size of the checkpoints even though each
tensor is dropped after use. Here each tensor (or block of rows) is read with ``readinto`` into a
fresh buffer, so what is resident is exactly the tensors the caller holds; the kernel's page cache
is not charged to the process.

The safetensors layout (https://huggingface.co/docs/safetensors, "Format"): an 8-byte
little-endian header length ``N``, ``N`` bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``, then the tensor data, offsets relative to
byte ``8 + N``, row-major, little-endian.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

CHECKPOINT_NAME = "model.safetensors"
CHECKPOINT_INDEX_NAME = "model.safetensors.index.json"
# A Hugging Face model folder's files besides its weights: its config and every tokenizer layout's
# files (a fast tokenizer's tokenizer.json; a BPE's vocab.json and merges.txt; SentencePiece's
# tokenizer.model; WordPiece's vocab.txt), copied with a checkpoint written from a base
SIDECAR_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")

# safetensors dtype string → (torch dtype, bytes per element)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # the format caps the header at 100 MB


class CheckpointError(ValueError):
    """A safetensors file or index is missing, truncated or malformed."""


# config.json keys that make two checkpoints different architectures (the vocabulary may differ: resized)
ARCHITECTURE_KEYS = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "hidden_size", "intermediate_size")


def read_json(path: str | Path) -> dict | None:
    """The JSON object in the file ``path``; None where it is missing, unreadable or not an object
    (a record beside a checkpoint that may be absent: ``config.json``, ``merge.json``, ...)."""
    try:
        out = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):  # (JSON nested past the parser's depth)
        return None
    return out if isinstance(out, dict) else None


def read_config(folder: str | Path) -> dict | None:
    """A checkpoint's ``config.json`` with a nested ``text_config`` (a multimodal model's language
    model) laid over it; None where it has no readable one."""
    config = read_json(Path(folder) / "config.json")
    text = None if config is None else config.get("text_config")  # a multimodal config nests the language model's
    return {**config, **text} if isinstance(text, dict) else config


def ties_head(folder: str | Path) -> bool:
    """Whether a checkpoint's config ties its LM head to its embedding (``tie_word_embeddings``):
    transformers then ignores a stored ``lm_head.weight``, and so do the export, the merge and the
    server."""
    return (read_config(folder) or {}).get("tie_word_embeddings") is True


def check_same_architecture(folders) -> None:
    """Refuse checkpoints whose ``config.json`` give different :data:`ARCHITECTURE_KEYS` (a folder
    without a readable config is not compared): ValueError naming the key and both folders. A
    fine-tune or merge of a base has the base's architecture; a Qwen2 model over a Llama base, or
    one with more layers, would be stored or merged as something it is not."""
    configs = [(Path(f), read_config(f)) for f in folders]
    for key in ARCHITECTURE_KEYS:
        seen: dict[str, Path] = {}
        for folder, config in configs:
            if config is not None and config.get(key) is not None:  # (null: not given)
                seen.setdefault(json.dumps(config[key]), folder)
        if len(seen) > 1:
            (a, fa), (b, fb) = list(seen.items())[:2]
            raise ValueError(f"the checkpoints are of different architectures: {key} {a} in {fa}/config.json, "
                             f"{b} in {fb}/config.json")


def load_tokenizer(path: str | Path):
    """``AutoTokenizer.from_pretrained(path)`` of a checkpoint folder, or a CheckpointError saying
    that the folder holds no tokenizer transformers can load (where transformers says it would need
    sentencepiece or tiktoken to convert a slow tokenizer that is not there either)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        have = sorted(p.name for p in Path(path).glob("*token*")) if Path(path).is_dir() else []
        raise CheckpointError(
            f"{path}: no tokenizer that transformers can load ({'found ' + ', '.join(have) if have else 'no tokenizer files'}"
            f"; a fast tokenizer is tokenizer.json): save the model's tokenizer beside its weights, "
            f"tokenizer.save_pretrained({str(path)!r}) ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, absolute byte offset, dtype, shape."""

    file: Path
    offset: int  # absolute offset of the first byte in ``file``
    nbytes: int
    dtype: torch.dtype
    dtype_name: str  # the safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the tensor viewed as ``[prod(shape[:-1]), shape[-1]]``."""
        return (self.shape[-1] if self.shape else 1) * self.dtype.itemsize


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse the header of one safetensors file and check every entry against the file size.

    Returns:
        tensor name → :class:`TensorInfo` (``__metadata__`` dropped).

    Raises:
        CheckpointError: the file is shorter than its header says, the header is not JSON of the
            documented shape, a dtype is unknown, or a tensor's byte range does not match its
            dtype × shape or lies outside the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (nested past the parser's depth)
            raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object")
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            dtype = DTYPES[dtype_name]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed header entry for {name!r} ({e!r})") from e
        if any(type(d) is not int or d < 0 for d in shape) or type(begin) is not int or type(end) is not int:
            raise CheckpointError(f"{path}: malformed shape or offsets for {name!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or 8 + n + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype_name} {list(shape)}, {nbytes} bytes) has byte range "
                f"[{begin}, {end}) that does not fit the file ({size} bytes): truncated or corrupt"
            )
        out[name] = TensorInfo(path, 8 + n + begin, nbytes, dtype, dtype_name, shape)
    return out


class Checkpoint:
    """A Hugging Face safetensors checkpoint folder, read one tensor (or block of rows) at a time.

    Accepts ``model.safetensors`` or ``model.safetensors.index.json`` + shards. Headers are parsed
    up front (a few MB for a 70B model); tensor data is read only on request, with plain file
    reads (no memory map), so the caller's resident memory is what it keeps.

    Raises (constructor):
        FileNotFoundError: the folder holds neither file.
        CheckpointError: a malformed index or header, a missing shard, a tensor in two shards.
    """

    def __init__(self, checkpoint_dir: str | Path):
        self.dir = Path(checkpoint_dir)
        index = self.dir / CHECKPOINT_INDEX_NAME
        single = self.dir / CHECKPOINT_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
                raise CheckpointError(f"{index}: not a Hugging Face safetensors index ({e!r})") from e
        elif single.is_file():
            weight_map, files = None, [CHECKPOINT_NAME]
        else:
            raise FileNotFoundError(
                f"{self.dir}: no {CHECKPOINT_NAME} or {CHECKPOINT_INDEX_NAME} "
                "(a Hugging Face safetensors checkpoint is expected)"
            )
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            path = self.dir / file
            if Path(file).name != file or not path.is_file():
                raise CheckpointError(f"{self.dir}: shard {file!r} listed in the index is missing")
            for name, info in read_header(path).items():
                if name in self.tensors:
                    raise CheckpointError(f"{self.dir}: tensor {name!r} is in two shards")
                self.tensors[name] = info
        if weight_map is not None:
            for name, file in weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != file:
                    raise CheckpointError(f"{index}: {name!r} is not in shard {file!r}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        """Tensor names, sorted (so the order does not depend on how the checkpoint is sharded)."""
        return sorted(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def nbytes(self) -> int:
        """Bytes of tensor data in the checkpoint."""
        return sum(t.nbytes for t in self.tensors.values())

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor, freshly allocated on the CPU, in its stored dtype and shape."""
        info = self.tensors[name]
        return self._read(info, info.offset, info.nbytes).view(info.dtype).reshape(info.shape)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the tensor viewed as ``[prod(shape[:-1]), shape[-1]]``.

        Returns:
            ``[stop − start, shape[-1]]`` in the stored dtype (a 0-D or 1-D tensor is one row).
        """
        info = self.tensors[name]
        rows = info.numel // max(info.shape[-1] if info.shape else 1, 1) if info.numel else 0
        if not 0 <= start <= stop <= rows:
            raise IndexError(f"{name}: rows {start}:{stop} out of range for {rows} rows")
        width = info.shape[-1] if info.shape else 1
        t = self._read(info, info.offset + start * info.row_bytes, (stop - start) * info.row_bytes)
        return t.view(info.dtype).reshape(stop - start, width)

    def get_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of the flattened tensor (1-D, stored dtype)."""
        info = self.tensors[name]
        if not 0 <= start <= stop <= info.numel:
            raise IndexError(f"{name}: elements {start}:{stop} out of range for {info.numel}")
        size = info.dtype.itemsize
        return self._read(info, info.offset + start * size, (stop - start) * size).view(info.dtype)

    @staticmethod
    def _read(info: TensorInfo, offset: int, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            view = memoryview(buf.numpy())
            with open(info.file, "rb", buffering=0) as f:
                f.seek(offset)
                got = 0
                while got < nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise CheckpointError(f"{info.file}: unexpected end of file (truncated?)")
                    got += n
        return buf


def row_block(info: TensorInfo, max_elements: int = 1 << 24) -> int:
    """Rows per block so that a float32 block of ``info``'s rows stays under ``max_elements``."""
    width = info.shape[-1] if info.shape else 1
    return max(1, max_elements // max(width, 1))


