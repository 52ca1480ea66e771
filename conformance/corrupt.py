"""Damage a checkpoint the ways storage and attackers do: truncate, flip a bit, delete, or replace
with a pickle that runs code when loaded."""
from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

KINDS = ("truncate", "bitflip", "delete")


def truncate(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return f"truncated {path.name} from {size} to {size // 2} bytes"


def _zip_tensor_offsets(path: Path) -> list[tuple[int, int]]:
    """(offset, length) of every tensor-data record in a torch zip checkpoint."""
    try:
        with zipfile.ZipFile(path) as zf:
            records = [i for i in zf.infolist() if "/data/" in i.filename and i.file_size >= 4]
    except (zipfile.BadZipFile, OSError):
        return []
    found = []
    with open(path, "rb") as f:
        for rec in records:
            f.seek(rec.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            found.append((rec.header_offset + 30 + name_len + extra_len, rec.file_size))
    return found


def _safetensors_offset(path: Path) -> tuple[int, int] | None:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    best = None
    for name, info in header.items():
        if name == "__metadata__" or info.get("dtype") != "F32":
            continue
        start, end = info["data_offsets"]
        if best is None or end - start > best[1]:
            best = (8 + n + start, end - start)
    return best


def bitflip(path: Path) -> str:
    """Flip the top exponent bit of the first float32 of every tensor in the file: each such
    weight becomes ~1e38 or ~1e-38, which no silent load can hide from the loss curve (a single
    flip could land in state the curve never reads, such as an RNG seed field)."""
    located = _zip_tensor_offsets(path)
    if not located:
        one = _safetensors_offset(path)
        located = [one] if one else []
    # little-endian float32: byte 3 holds sign + 7 exponent bits
    offsets = [offset + 3 for offset, _ in located] or [path.stat().st_size // 2]
    where = f"{len(located)} tensor record(s)" if located else "middle of file"
    with open(path, "r+b") as f:
        for offset in offsets:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x40]))
    return f"flipped bit 0x40 of byte 3 in {where} of {path.name}"


def delete(path: Path) -> str:
    path.unlink()
    return f"deleted {path.name}"


def corrupt(kind: str, path: Path) -> str:
    return {"truncate": truncate, "bitflip": bitflip, "delete": delete}[kind](path)


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        code = f"open({self.marker!r}, 'w').write('untrusted checkpoint code ran')"
        return (exec, (code,))


def plant_malicious_pickle(path: Path, marker: Path) -> str:
    """Replace `path` with a pickle whose loading runs code that creates `marker`."""
    data = pickle.dumps({"state_dict": _RunsCode(str(marker))}, protocol=2)
    tmp = path.with_name(path.name + ".conformance-tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return f"replaced {path.name} with a code-running pickle"
