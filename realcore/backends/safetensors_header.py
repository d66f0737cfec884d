"""What a `.safetensors` file holds (names, dtypes, shapes), read from its header alone, and checked
against the file's size, so an update from disk is refused (ValueError naming the file) before any
tensor is read: a garbage or truncated file, an unknown name, a wrong shape.

The format (https://github.com/huggingface/safetensors): 8 bytes, the header's length N (little
endian); N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...};
then the data, offsets counted from its start.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct

# safetensors' dtype names -> bytes per element
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOATS = {"F16", "BF16", "F32", "F64"}  # what a weight update may carry (the engine casts on copy)
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of the file at `path`; ValueError naming the file if it is not a
    whole safetensors file (bad header, an entry past its end)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("not a safetensors file (its first 8 bytes are no header length that fits the file)")
            try:
                raw = json.loads(f.read(n))
            except ValueError as e:
                raise ValueError(f"not a safetensors file (its header is not JSON: {e})") from None
            if not isinstance(raw, dict):
                raise ValueError("not a safetensors file (its header is not a JSON object)")
            out = {}
            for name, entry in raw.items():
                if name != "__metadata__":
                    out[name] = _entry(name, entry, size - 8 - n)
            return out
    except (ValueError, OSError, UnicodeDecodeError) as e:  # json's errors are ValueErrors
        raise ValueError(f"weights: {path}: {e}") from None


def _entry(name: str, entry, data_bytes: int) -> tuple[str, tuple[int, ...]]:
    if not isinstance(entry, dict):
        raise ValueError(f"tensor {name!r}: not an entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEMSIZE:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name!r}: bad data_offsets {offsets!r}")
    if offsets[1] - offsets[0] != math.prod(shape) * ITEMSIZE[dtype]:
        raise ValueError(f"tensor {name!r}: data_offsets {offsets} do not hold a {dtype} tensor of shape {shape}")
    if offsets[1] > data_bytes:
        raise ValueError(f"tensor {name!r} ends at data byte {offsets[1]} but the file holds {data_bytes} (truncated?)")
    return dtype, tuple(shape)


def check_against(path: str, entries: dict[str, tuple[str, tuple[int, ...]]],
                  shapes: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming `path` when an entry is not a floating-point tensor of a name and shape in `shapes`."""
    unknown = sorted(n for n in entries if n not in shapes)
    wrong = sorted(n for n, (_, shape) in entries.items() if n in shapes and shape != tuple(shapes[n]))
    not_float = sorted(n for n, (dtype, _) in entries.items() if dtype not in FLOATS)
    for what, names in (("unknown", unknown), ("wrongly shaped", wrong), ("not floating-point", not_float)):
        if names:
            e = names[0]
            detail = f" ({entries[e][1]}, the model's {tuple(shapes[e])})" if what == "wrongly shaped" else ""
            raise ValueError(f"weights: {path}: {len(names)} {what} tensor(s), e.g. {names[:3]}{detail}")


def check_dir(path: str, shapes: dict[str, tuple[int, ...]], required: set[str]) -> None:
    """A whole update from the `*.safetensors` files of directory `path`: every file's header is
    whole and matches `shapes`, and together they hold every name of `required` (ValueError)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
    if not files:
        raise ValueError(f"weights: {path!r} is not a directory holding *.safetensors files")
    names: set[str] = set()
    for f in files:
        entries = header(f)
        check_against(f, entries, shapes)
        names.update(entries)
    missing = sorted(required - names)
    if missing:
        raise ValueError(f"weights: {path}: {len(missing)} missing parameter(s), e.g. {missing[:3]}")
