"""Facts read from a GGUF file that transformers' GGUF loading leaves out: the tokenizer's pre-tokenizer type
(`tokenizer.ggml.pre`), read from the file's header alone."""

from __future__ import annotations

import struct
from pathlib import Path

from ..errors import UserError


class GGUFError(UserError):
    """A GGUF file whose header cannot be read (cut short, or not a GGUF of a version we read)."""


def _digits_then_byte_level():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                             use_regex=True)])


# A GGUF names its tokenizer's pre-tokenizer by llama.cpp's type (`tokenizer.ggml.pre`), which transformers' GGUF
# conversion does not read: it gives every BPE vocabulary GPT-2's ByteLevel split. For the types below that split is
# not the model's own, and text tokenizes differently from what the model emits: SmolLM2 ("smollm") puts each digit
# in its own piece first (its tokenizer.json: Sequence[Digits(individual_digits), ByteLevel]), so "\n\n1." is
# "\n\n" + "1" + "." for the model but "\n" + "\n" + "1" + "." with GPT-2's split, and training data rendered
# through that split held tokens the target never emits at every list after a blank line
# (benchmarks/regen_drift_cpu.py). Each entry builds the model's own pre-tokenizer.
GGUF_PRE_TOKENIZERS = {"smollm": _digits_then_byte_level}


def restore_gguf_pre_tokenizer(tokenizer, gguf_path: Path) -> None:
    """Give a tokenizer loaded from gguf_path its model's own pre-tokenizer (GGUF_PRE_TOKENIZERS), if it has one."""
    pre = gguf_string_value(gguf_path, "tokenizer.ggml.pre")
    if pre in GGUF_PRE_TOKENIZERS:
        tokenizer.backend_tokenizer.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()


# GGUF metadata value types (the GGUF spec's gguf_metadata_value_type) -> struct format of one value; 8 is a string
# (uint64 length + UTF-8 bytes), 9 an array (uint32 item type + uint64 count + items).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_string_value(path: Path, key: str) -> str | None:
    """The string stored under `key` in a GGUF file's metadata, or None if it has none; reads the header's key-value
    pairs up to that key and skips every value on the way. gguf's GGUFReader maps the whole file and builds a view of
    each vocabulary entry and tensor (2.3 s for SmolLM2-135M on the dev box, where this takes milliseconds). Files of
    either byte order are read, as llama.cpp writes them: the version number tells which."""
    with open(path, "rb") as f:
        def read(size: int) -> bytes:
            raw = f.read(size)
            if len(raw) != size:
                raise GGUFError(f"GGUF file {str(path)!r} ends inside its metadata; download or copy it again.")
            return raw

        def unpack(fmt: str):
            return struct.unpack(order + fmt, read(struct.calcsize(order + fmt)))[0]

        def skip(value_type: int) -> None:
            if value_type == _GGUF_STRING:
                f.seek(unpack("Q"), 1)
            elif value_type == _GGUF_ARRAY:
                item_type, count = unpack("I"), unpack("Q")
                if item_type in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize(_GGUF_SCALARS[item_type]), 1)
                else:
                    for _ in range(count):
                        skip(item_type)
            elif value_type in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[value_type]), 1)
            else:
                raise GGUFError(f"GGUF file {str(path)!r} has a metadata value of unknown type {value_type}; "
                                "download or copy it again, or convert it with a current llama.cpp.")

        magic, version = f.read(4), f.read(4)
        # unpack() reads in the byte order in which the version is 2 or 3
        known = magic == b"GGUF" and len(version) == 4
        order = next((o for o in "<>" if known and struct.unpack(o + "I", version)[0] in (2, 3)), None)
        if order is None:
            raise GGUFError(f"{str(path)!r} is not a GGUF file of version 2 or 3; convert it with a current "
                            "llama.cpp.")
        unpack("Q")  # the tensor count: tensor infos follow the metadata, never read here
        for _ in range(unpack("Q")):
            name = read(unpack("Q")).decode("utf-8", errors="replace")
            value_type = unpack("I")
            if name == key and value_type == _GGUF_STRING:
                return read(unpack("Q")).decode("utf-8", errors="replace")
            skip(value_type)
    return None
