"""Damage a checkpoint the ways storage and attackers do: truncate, flip a bit, delete, or replace
with a pickle that runs code when loaded."""
from __future__ import annotations

import json
import os
import pickle
import pickletools
import struct
import tempfile
import zipfile
from pathlib import Path

KINDS = ("truncate", "bitflip", "delete")


def truncate(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return f"truncated {path.name} from {size} to {size // 2} bytes"


_STORAGE_WIDTHS = {"DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2}


def _zip_storage_widths(pickle_bytes: bytes) -> dict[str, int]:
    """Storage key -> element width, for the floating-point storages a torch zip's data.pkl names.

    Read from the pickle's opcodes without unpickling anything: each storage is persisted as
    ('storage', torch.<Type>Storage, key, location, numel), so the string pushed right after a
    storage class is its key (the class may come back from the memo for later tensors)."""
    memo: dict[int, object] = {}
    strings: list[str] = []
    last: object = None
    pending: str | None = None      # storage type whose key comes next
    widths: dict[str, int] = {}
    try:
        for op, arg, _ in pickletools.genops(pickle_bytes):
            name = op.name
            if name in ("GLOBAL", "STACK_GLOBAL"):
                module, cls = (arg.split(" ", 1) if name == "GLOBAL" else (strings[-2:] + ["", ""])[:2])
                last = ("class", module, cls)
                if module == "torch" and cls.endswith("Storage"):
                    pending = cls
            elif name in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(arg)
                last = arg
                if pending is not None:
                    if pending in _STORAGE_WIDTHS:
                        widths[arg] = _STORAGE_WIDTHS[pending]
                    pending = None
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = last
            elif name == "MEMOIZE":
                memo[len(memo)] = last
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                last = memo.get(int(arg))
                if isinstance(last, tuple) and last[1] == "torch" and last[2].endswith("Storage"):
                    pending = last[2]
    except (ValueError, IndexError):
        pass
    return widths


def _archive_starts(path: Path) -> list[int]:
    """Offsets of the torch zip archives in a file: one for `torch.save`, several for a file that
    concatenates one archive per tensor (DCP's `.distcp` shards). An archive starts with the local
    header of its `data.pkl`."""
    data = path.read_bytes()
    starts, at = [], data.find(b"PK\x03\x04")
    while at != -1:
        if at + 30 <= len(data):
            (name_len,) = struct.unpack("<H", data[at + 26:at + 28])
            if data[at + 30:at + 30 + name_len].endswith(b"data.pkl"):
                starts.append(at)
        at = data.find(b"PK\x03\x04", at + 4)
    return starts


def _zip_tensor_offsets(path: Path) -> list[tuple[int, int]]:
    """(offset, element width) of every floating-point tensor-data record in a torch zip checkpoint,
    or in every archive of a file that concatenates them."""
    try:
        starts = _archive_starts(path)
    except OSError:
        return []
    if len(starts) > 1:
        data = path.read_bytes()
        found = []
        with tempfile.TemporaryDirectory(prefix="conformance-archive-") as tmp:
            piece = Path(tmp) / "piece"
            for start, end in zip(starts, starts[1:] + [len(data)]):
                piece.write_bytes(data[start:end])
                found += [(start + offset, width) for offset, width in _zip_tensor_offsets(piece)]
        return found
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = next((i for i in zf.infolist() if i.filename.endswith("data.pkl")), None)
            widths = _zip_storage_widths(zf.read(pkl)) if pkl is not None else {}
            records = [(i, widths[i.filename.rsplit("/", 1)[1]]) for i in zf.infolist()
                       if "/data/" in i.filename and i.filename.rsplit("/", 1)[1] in widths
                       and i.file_size >= widths[i.filename.rsplit("/", 1)[1]]]
    except (zipfile.BadZipFile, OSError, KeyError):
        return []
    found = []
    with open(path, "rb") as f:
        for rec, width in records:
            f.seek(rec.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            found.append((rec.header_offset + 30 + name_len + extra_len, width))
    return found


_FLOAT_WIDTHS = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def _safetensors_offset(path: Path) -> tuple[int, int] | None:
    """(offset, element width) of the largest floating-point tensor in a safetensors file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    best, best_len = None, -1
    for name, info in header.items():
        if name == "__metadata__" or info.get("dtype") not in _FLOAT_WIDTHS:
            continue
        start, end = info["data_offsets"]
        if end - start >= _FLOAT_WIDTHS[info["dtype"]] and end - start > best_len:
            best, best_len = (8 + n + start, _FLOAT_WIDTHS[info["dtype"]]), end - start
    return best


def bitflip(path: Path) -> str:
    """Flip the top exponent bit of the first element of every floating-point tensor in the file
    (byte 1 of a float16/bfloat16, 3 of a float32, 7 of a float64, little-endian): each such
    weight becomes huge or tiny, which no silent load can hide from the loss curve (a single flip
    could land in state the curve never reads, such as an RNG seed field). In a file of another
    format, bit 6 of the 8 bytes in its middle."""
    located = _zip_tensor_offsets(path)
    if not located:
        one = _safetensors_offset(path)
        located = [one] if one else []
    if located:
        offsets = [offset + width - 1 for offset, width in located]
        where = f"{len(located)} floating-point tensor record(s)"
    else:
        # A format this module cannot read: bit 6 of 8 consecutive bytes in the middle. If they
        # lie in an array of float16/bfloat16/float32/float64, whatever its alignment, one of
        # them is the top byte of an element, so its exponent's top bit flips too (one flipped
        # byte could land in a mantissa's low bits and change nothing a curve shows).
        middle = path.stat().st_size // 2
        offsets = list(range(max(0, middle - 4), min(path.stat().st_size, middle + 4)))
        where = f"{len(offsets)} consecutive bytes in the middle"
    with open(path, "r+b") as f:
        for offset in offsets:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x40]))
    if located:
        return f"flipped the top exponent bit of the first element in {where} of {path.name}"
    return f"flipped bit 6 of {where} of {path.name}"


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
