"""How one piece of a chained checkpoint is stored: a tagged header, then raw or compressed bytes.

A piece file is

    b"RCPC" | u8 format version | u32 header length | header (JSON) | payload

with the header naming its codec (`raw`, `zstd`, or `zstd-shuffle` with the itemsize it was
shuffled by), its raw (uncompressed) length and its stored length. Every piece says how to read
it, so compressed and uncompressed checkpoints load the same way and a future codec is one more
tag. A piece is named by the sha256 of its raw bytes; decoding checks the stored length (a cut
file), the raw length and that hash, so a truncated or flipped piece never decodes to a shorter
or different tensor.

Byte shuffling (all first bytes of the elements, then all second bytes, ...) puts the slowly
varying sign/exponent bytes of floats next to each other, which zstd then finds; it applies to
float16, bfloat16, float32 and float64, and other dtypes are compressed as they are.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct

import numpy as np
import torch

from ..errors import CorruptCheckpointError

MAGIC = b"RCPC"
VERSION = 1
_PREFIX = struct.Struct("<4sBI")
_MAX_HEADER = 1 << 16
_READ_CHUNK = 8 << 20
CODECS = ("raw", "zstd", "zstd-shuffle")
SHUFFLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class CompressionUnavailable(ImportError):
    """compression was asked for but the zstandard package is not installed."""


def zstandard_available() -> bool:
    """Whether compression can be used here (the 'compression' extra is installed)."""
    import importlib.util
    return importlib.util.find_spec("zstandard") is not None


def _zstd():
    try:
        import zstandard
    except ImportError as exc:
        raise CompressionUnavailable(
            "compression needs the zstandard package: pip install 'resume-conformance[compression]' "
            "(or pip install zstandard)") from exc
    return zstandard


@dataclasses.dataclass(frozen=True)
class Compression:
    """zstd at `level` (1 fast .. 19 small; negative levels faster still), float tensors
    byte-shuffled first unless `shuffle` is False, with `threads` worker threads per piece."""

    level: int = 1
    shuffle: bool = True
    threads: int = 0

    def __post_init__(self):
        if isinstance(self.level, bool) or not isinstance(self.level, int) or not -7 <= self.level <= 22:
            raise ValueError(f"compression level must be an integer from -7 to 22, got {self.level!r}")
        _zstd()   # fail at configuration time, not in the middle of a save


_BLOCK = 1 << 18      # bytes per block of the (un)shuffle loop: a block and its planes stay in cache
_SAMPLE = 1 << 16     # bytes of a plane compressed to decide whether the plane is worth compressing
_MIN_GAIN = 1.03      # a plane whose sample shrinks less than this is stored as it is


def shuffle_bytes(raw, itemsize: int) -> np.ndarray:
    """(itemsize, n) array: row p holds byte p of every element (the byte planes)."""
    elems = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize)
    planes = np.empty((itemsize, elems.shape[0]), dtype=np.uint8)
    step = max(1, _BLOCK // itemsize)
    for i in range(0, elems.shape[0], step):
        planes[:, i:i + step] = elems[i:i + step].T
    return planes


def unshuffle_bytes(planes: np.ndarray) -> np.ndarray:
    """The flat bytes of the elements whose byte planes are the rows of `planes`."""
    itemsize, n = planes.shape
    elems = np.empty((n, itemsize), dtype=np.uint8)
    step = max(1, _BLOCK // itemsize)
    for i in range(0, n, step):
        for k in range(itemsize):      # one plane at a time: contiguous reads (a block's .T is slower)
            elems[i:i + step, k] = planes[k, i:i + step]
    return elems.reshape(-1)


def _plane_compressor(level: int):
    """zstd for one byte plane: long minimum matches and the smallest hash table (float planes have
    few repeats; their gain is in the entropy coding of literals). On the sign/exponent plane of
    trained fp32 weights at level 1, hash_log 6 compressed at about twice the speed of 12 and
    slightly smaller (2.98x against 2.85x); at level 3 it made no measurable difference."""
    zstd = _zstd()
    params = zstd.ZstdCompressionParameters.from_level(level, min_match=7, hash_log=6, write_content_size=1)
    return zstd.ZstdCompressor(compression_params=params)


def _compress_plane(plane: np.ndarray, cctx) -> tuple[str, bytes | np.ndarray]:
    if len(plane) > 4 * _SAMPLE:
        sample = plane[:_SAMPLE]
        if len(sample) < len(cctx.compress(sample)) * _MIN_GAIN:
            return "raw", plane          # the mantissa planes of floats: noise, not worth zstd's time
    packed = cctx.compress(plane)
    return ("zstd", packed) if len(packed) * _MIN_GAIN <= len(plane) else ("raw", plane)


def codec_for(dtype: torch.dtype | None, compression: Compression | None) -> str:
    if compression is None:
        return "raw"
    return "zstd-shuffle" if compression.shuffle and dtype in SHUFFLE_DTYPES else "zstd"


def encode(raw: memoryview | bytes, *, dtype: torch.dtype | None = None,
           compression: Compression | None = None) -> tuple[list, dict]:
    """A piece file's bytes for `raw` (as buffers to write one after the other), and its header
    (codec, raw_bytes, stored_bytes)."""
    codec = codec_for(dtype, compression)
    header: dict = {"codec": codec, "raw_bytes": len(raw)}
    if codec == "raw":
        parts = [raw]
    elif codec == "zstd":
        parts = [_zstd().ZstdCompressor(level=compression.level, threads=compression.threads,
                                        write_content_size=True).compress(raw)]
        header["level"] = compression.level
    else:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        cctx = _plane_compressor(compression.level)
        planes = [_compress_plane(plane, cctx) for plane in shuffle_bytes(raw, itemsize)]
        header.update(itemsize=itemsize, level=compression.level,
                      planes=[[kind, len(memoryview(data).cast("B"))] for kind, data in planes])
        parts = [data for _, data in planes]
    payload_len = sum(len(memoryview(p).cast("B")) for p in parts)
    header["stored_bytes"] = payload_len
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return [_PREFIX.pack(MAGIC, VERSION, len(head)) + head, *parts], header


def _decompress(data, size: int, path) -> bytes:
    try:
        return _zstd().ZstdDecompressor().decompress(data, max_output_size=size)
    except CompressionUnavailable:
        raise
    except Exception as exc:   # zstandard.ZstdError: a damaged frame
        raise CorruptCheckpointError(path, f"piece does not decompress: {exc}") from None


def parse_header(blob: bytes | memoryview, path) -> tuple[dict, int]:
    """(header, payload offset) from a piece's first bytes; CorruptCheckpointError if malformed."""
    if len(blob) < _PREFIX.size:
        raise CorruptCheckpointError(path, f"piece is {len(blob)} bytes, shorter than its header")
    magic, version, head_len = _PREFIX.unpack_from(blob, 0)
    if magic != MAGIC:
        raise CorruptCheckpointError(path, f"not a piece file (magic {bytes(magic)!r})")
    if version != VERSION:
        raise CorruptCheckpointError(path, f"piece format version {version} is not one this library reads "
                                           f"(it reads {VERSION})")
    end = _PREFIX.size + head_len
    if head_len > _MAX_HEADER or end > len(blob):
        raise CorruptCheckpointError(path, "piece header cut short")
    try:
        header = json.loads(bytes(blob[_PREFIX.size:end]))
    except ValueError as exc:
        raise CorruptCheckpointError(path, f"piece header is not JSON: {exc}") from None
    if (not isinstance(header, dict) or header.get("codec") not in CODECS
            or not all(isinstance(header.get(k), int) and header[k] >= 0 for k in ("raw_bytes", "stored_bytes"))):
        raise CorruptCheckpointError(path, f"piece header invalid: {header!r}"[:300])
    return header, end


def _check_digest(raw: np.ndarray, digest: str, path, verify: bool) -> np.ndarray:
    if verify:
        actual = hashlib.sha256(raw).hexdigest()
        if actual != digest:
            raise CorruptCheckpointError(path, f"piece's sha256 is {actual[:16]}..., its name says {digest[:16]}...")
    return raw


def _decode_payload(header: dict, payload: memoryview, path) -> np.ndarray:
    if len(payload) != header["stored_bytes"]:
        raise CorruptCheckpointError(path, f"piece payload is {len(payload)} bytes, its header says "
                                           f"{header['stored_bytes']} (cut short or extended)")
    codec, n = header["codec"], header["raw_bytes"]
    if codec == "raw":
        raw = np.frombuffer(payload, dtype=np.uint8).copy()
    elif codec == "zstd":
        raw = np.frombuffer(_decompress(payload, n, path), dtype=np.uint8).copy()
    else:
        itemsize, planes = header.get("itemsize"), header.get("planes")
        if (not isinstance(itemsize, int) or itemsize < 1 or n % itemsize or not isinstance(planes, list)
                or len(planes) != itemsize
                or not all(isinstance(p, list) and len(p) == 2 and p[0] in ("raw", "zstd")
                           and isinstance(p[1], int) and p[1] >= 0 for p in planes)
                or sum(p[1] for p in planes) != len(payload)):
            raise CorruptCheckpointError(path, "piece header's byte planes do not fit its bytes")
        out = np.empty((itemsize, n // itemsize), dtype=np.uint8)
        pos = 0
        for i, (kind, size) in enumerate(planes):
            chunk = payload[pos:pos + size]
            pos += size
            data = chunk if kind == "raw" else _decompress(chunk, n // itemsize, path)
            if len(data) != n // itemsize:
                raise CorruptCheckpointError(path, f"byte plane {i} holds {len(data)} bytes, expected {n // itemsize}")
            out[i] = np.frombuffer(data, dtype=np.uint8)
        raw = unshuffle_bytes(out)
    if len(raw) != n:
        raise CorruptCheckpointError(path, f"piece decodes to {len(raw)} bytes, its header says {n}")
    return raw


def decode(blob: bytes | memoryview, digest: str, path, *, verify: bool = True) -> np.ndarray:
    """The raw bytes of a piece file's bytes (a writable uint8 array), checked against its stored
    length, raw length and, unless `verify` is False, `digest`."""
    header, start = parse_header(blob, path)
    return _check_digest(_decode_payload(header, memoryview(blob)[start:], path), digest, path, verify)


def read_piece_file(path, digest: str, *, verify: bool = True) -> np.ndarray:
    """decode() of the file at `path`; an uncompressed piece is read straight into the array it
    returns and hashed chunk by chunk as it arrives (one pass, no copy)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, min(size, _PREFIX.size + 4096), 0)
        if len(first) >= _PREFIX.size and _PREFIX.size + _PREFIX.unpack_from(first, 0)[2] > len(first):
            first = os.pread(fd, min(size, _PREFIX.size + _MAX_HEADER), 0)
        header, start = parse_header(first, path)
        if header["codec"] != "raw" or size - start != header["stored_bytes"]:
            return decode(os.pread(fd, size, 0) if size > len(first) else first, digest, path, verify=verify)
        raw = np.empty(header["raw_bytes"], dtype=np.uint8)
        view = memoryview(raw)
        h = hashlib.sha256() if verify else None
        pos = 0
        while pos < len(raw):
            n = os.preadv(fd, [view[pos:pos + _READ_CHUNK]], start + pos)
            if n == 0:
                raise CorruptCheckpointError(path, f"piece ends after {pos} of {len(raw)} payload bytes")
            if h is not None:
                h.update(view[pos:pos + n])
            pos += n
    finally:
        os.close(fd)
    if h is not None and h.hexdigest() != digest:
        raise CorruptCheckpointError(path, f"piece's sha256 is {h.hexdigest()[:16]}..., its name says {digest[:16]}...")
    return raw
