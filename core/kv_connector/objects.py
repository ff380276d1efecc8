"""What the tiers store: one self-checking object per KV block, named by its content.

An object's key is SHA-256 over the layout fingerprint and the block's prefix-cache key
(core/kv/hashing.py). The prefix-cache key already chains every token before and inside
the block and the tagged extra keys (cache salt), so two sessions that share a prefix
share its objects, and a tenant's salt keeps its objects apart. The fingerprint names the
model and the byte layout (dtype, layers, heads, block size): a different model, or the
same model at another dtype, never reads an object it cannot use.

Framing (`ObjectCodec`): a fixed 96-byte header then the payload. The header holds
magic, format version, flags, the key itself, the payload length, an XXH3-64 checksum of
the payload, 8 reserved zero bytes and a 32-byte tag. `decode` checks every byte of it
and that the length is the layout's payload size, so a truncated, bit-flipped, misfiled
or wrongly sized object is refused, never loaded. XXH3 because it runs at memory speed
(~20-50 GB/s here, against ~1 GB/s for zlib's CRC-32 and SHA-256): a load checks every
byte it copies.

A checksum stops storage damage, not an adversary: anyone who can write to a shared tier
(a Redis server, Mooncake's store, a disk directory) can frame a forged payload with a
valid checksum. With a MAC key (`--kv-offload-hmac-key`) every object carries an
HMAC-SHA256 tag over its header and payload, and objects read from a shared tier
(`KVTier.shared`) must carry a valid one: a forged or unkeyed object is refused like a
corrupt one. The host tier is this process's own memory, so its reads check the
checksum only.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import struct
from dataclasses import dataclass

from tokenmill.kv.hashing import BlockHash
from tokenmill.platforms.kv_tier import ObjectKey

_MAGIC = b"TMKV"
_VERSION = 2
# magic, version, flags, key, payload length, XXH3-64 of the payload, reserved, tag
_HEADER = struct.Struct("<4sHH32sQQ8s32s")
HEADER_BYTES = _HEADER.size  # 96
_TAG_OFFSET = HEADER_BYTES - 32
_FLAG_TAGGED = 1  # the tag is an HMAC-SHA256 of the header (tag zeroed) and the payload
_ZERO_TAG = bytes(32)
_RESERVED = bytes(8)


class CorruptObjectError(ValueError):
    """A stored object failed its checks (magic, key, length, checksum or tag)."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The byte layout of one block across all arena slots, and what produced it.

    `layer_shapes[s]` is slot s's page shape in elements of `itemsize` bytes: an engine
    describes each slot as bytes, (H, page_bytes // H) with itemsize 1 (H = 2: keys then
    values, or the two halves of state pages; 1: a block-major MLA page;
    `KVArena.page_rows`); a bare attention cache is [2, block_size, kv_heads, head_size].
    Payloads hold the pages of all slots in slot order: whatever the block holds in
    them (attention KV, MLA latents, a recurrent-state checkpoint page), which the
    model, named by `model_id`, fixes.
    """

    model_id: str  # the model's identity (path or name plus config digest)
    dtype: str  # torch dtype name, e.g. "bfloat16"
    block_size: int
    layer_shapes: tuple[tuple[int, ...], ...]
    itemsize: int
    # a digest of the KV scales when calibrated at load (calculate_kv_scales; the model
    # fixes any other: the checkpoint's or 1.0), else "": FP8 pages read right only with
    # the scales they were written with
    kv_scales: str = ""

    @property
    def page_bytes(self) -> int:
        n = self.itemsize
        for d in self.layer_shapes[0]:
            n *= d
        return n

    @property
    def payload_bytes(self) -> int:
        return self.page_bytes * len(self.layer_shapes)

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    def fingerprint(self) -> bytes:
        """32 bytes naming the model and layout; part of every object key."""
        doc = {
            "format": _VERSION,
            "model": self.model_id,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "layers": [list(s) for s in self.layer_shapes],
        }
        if self.kv_scales:  # uncalibrated layouts keep the fingerprints they had
            doc["kv_scales"] = self.kv_scales
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()


def object_key(fingerprint: bytes, block_hash: BlockHash) -> ObjectKey:
    """The storage key of the block whose prefix-cache key is `block_hash`."""
    return hashlib.sha256(fingerprint + block_hash).digest()


def _xxh3_64():
    """xxhash's XXH3-64, imported when offload is set up (an environment made before
    tokenmill depended on xxhash fails there, with what to do, not at `import tokenmill`)."""
    try:
        return importlib.import_module("xxhash").xxh3_64_intdigest
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "KV offload checksums objects with xxhash, a dependency of tokenmill: "
            "pip install 'xxhash>=3.4'"
        ) from exc


def checksum(payload: bytes | memoryview) -> int:
    """XXH3-64 of `payload` (runs at memory speed)."""
    return _xxh3_64()(payload)


class ObjectCodec:
    """Frames and checks the objects of one layout (`payload_bytes` each).

    `mac_key`: with one, `encode` tags every object (HMAC-SHA256 over the header and
    payload) and `decode(..., authenticate=True)` refuses an object without a valid tag;
    the stack authenticates what it reads from shared tiers (module doc)."""

    def __init__(self, payload_bytes: int, mac_key: bytes | None = None) -> None:
        if payload_bytes < 1:
            raise ValueError(f"payload_bytes={payload_bytes} must be >= 1")
        if mac_key is not None and len(mac_key) < 16:
            raise ValueError(
                f"the KV offload MAC key is {len(mac_key)} bytes; give at least 16 "
                "(e.g. 32 random bytes as hex: python -c 'import secrets; "
                "print(secrets.token_hex(32))')"
            )
        self.payload_bytes = payload_bytes
        self.object_bytes = HEADER_BYTES + payload_bytes
        self._mac_key = mac_key
        self.checksum = _xxh3_64()  # fails here, at setup, where xxhash is missing

    @property
    def authenticates(self) -> bool:
        return self._mac_key is not None

    def header(self, key: ObjectKey, payload: bytes | memoryview) -> bytes:
        """The header framing `payload` under `key` (tagged with a MAC key)."""
        view = memoryview(payload)
        flags = _FLAG_TAGGED if self._mac_key is not None else 0
        head = _HEADER.pack(_MAGIC, _VERSION, flags, key, view.nbytes, self.checksum(view),
                            _RESERVED, _ZERO_TAG)
        if self._mac_key is None:
            return head
        return head[:_TAG_OFFSET] + self._tag(head, view)

    def encode(self, key: ObjectKey, payload: bytes | memoryview) -> bytes:
        """Header plus payload, ready to store under `key`."""
        return self.header(key, payload) + bytes(payload)

    def _tag(self, head: bytes | memoryview, payload: memoryview) -> bytes:
        mac = hmac.new(self._mac_key, head[:_TAG_OFFSET], hashlib.sha256)
        mac.update(_ZERO_TAG)
        mac.update(payload)
        return mac.digest()

    def decode(
        self, key: ObjectKey, data: bytes | memoryview, authenticate: bool = False
    ) -> memoryview:
        """The payload of the object `data` stored under `key`, a view into `data` (no
        copy); CorruptObjectError naming the failed check otherwise. `authenticate`
        (a read from a shared tier): with a MAC key, the tag must be valid too."""
        view = memoryview(data).cast("B")
        name = key.hex()[:16]
        if len(view) < HEADER_BYTES:
            raise CorruptObjectError(f"object {name} is {len(view)} bytes, under a header")
        magic, version, flags, stored_key, length, digest, reserved, tag = _HEADER.unpack_from(view)
        if magic != _MAGIC or version != _VERSION:
            raise CorruptObjectError(f"object {name}: bad magic/version {magic!r}/{version}")
        if stored_key != key:
            raise CorruptObjectError(f"object {name} holds key {stored_key.hex()[:16]}")
        if flags & ~_FLAG_TAGGED or reserved != _RESERVED or (
            not flags & _FLAG_TAGGED and tag != _ZERO_TAG
        ):
            raise CorruptObjectError(f"object {name}: bad flags {flags} or reserved bytes")
        if length != self.payload_bytes:
            raise CorruptObjectError(
                f"object {name}: payload of {length} bytes, the layout's is {self.payload_bytes}"
            )
        payload = view[HEADER_BYTES:]
        if len(payload) != length:
            raise CorruptObjectError(
                f"object {name}: payload is {len(payload)} bytes, header says {length}"
            )
        if self.checksum(payload) != digest:
            raise CorruptObjectError(f"object {name}: checksum mismatch")
        if authenticate and self._mac_key is not None:
            if not flags & _FLAG_TAGGED:
                raise CorruptObjectError(f"object {name}: no MAC tag (an untrusted writer)")
            if not hmac.compare_digest(tag, self._tag(view[:HEADER_BYTES], payload)):
                raise CorruptObjectError(f"object {name}: MAC tag mismatch (forged or damaged)")
        return payload
