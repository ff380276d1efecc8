"""Tier objects are checked before they are loaded: a well-framed object of the wrong size,
and (with `kv_offload_hmac_key`) a forged object with a valid checksum, are refused,
deleted and counted as misses. The engine recomputes what they held, with the output of
an engine that never saw them, and stays up: before these checks one such object on disk
crashed the engine on every request that reached it, a restart included."""

from __future__ import annotations

import os

import pytest
from test_kv_tiers import LAYOUT, obj
from test_offload_engine import GREEDY, make_llm

from tokenmill.kv_connector.objects import HEADER_BYTES, CorruptObjectError, ObjectCodec

KEY = "offload-test-key-0123456789"


def test_the_codec_checks_size_checksum_and_tag():
    key, data = obj(3)
    plain = ObjectCodec(LAYOUT.payload_bytes)
    keyed = ObjectCodec(LAYOUT.payload_bytes, KEY.encode())
    # a well-framed object (header, length and checksum consistent) of another size
    other = ObjectCodec(LAYOUT.payload_bytes + 64).encode(key, bytes(LAYOUT.payload_bytes + 64))
    with pytest.raises(CorruptObjectError, match="the layout's is"):
        plain.decode(key, other)
    # a forged payload framed with a valid checksum: only a MAC tells it apart
    forged = plain.encode(key, os.urandom(LAYOUT.payload_bytes))
    assert bytes(plain.decode(key, forged)) == forged[HEADER_BYTES:]
    with pytest.raises(CorruptObjectError, match="no MAC tag"):
        keyed.decode(key, forged, authenticate=True)
    wrong = ObjectCodec(LAYOUT.payload_bytes, b"another key 0123456789").encode(key, forged[HEADER_BYTES:])
    with pytest.raises(CorruptObjectError, match="MAC tag mismatch"):
        keyed.decode(key, wrong, authenticate=True)
    tagged = keyed.encode(key, data[HEADER_BYTES:])
    assert bytes(keyed.decode(key, tagged, authenticate=True)) == data[HEADER_BYTES:]
    # a tag is bound to the key the object is stored under and to every payload byte
    flipped = bytearray(tagged)
    flipped[-1] ^= 1
    with pytest.raises(CorruptObjectError):
        keyed.decode(key, bytes(flipped), authenticate=True)
    with pytest.raises(CorruptObjectError, match="holds key"):
        keyed.decode(obj(4)[0], tagged, authenticate=True)
    with pytest.raises(ValueError, match="at least 16"):
        ObjectCodec(LAYOUT.payload_bytes, b"short")


def _disk_llm(tiny_dirs, disk, **kw):
    # a pool of 24 blocks, no host tier: what the device lacks comes from disk
    return make_llm(tiny_dirs["llama"], num_kv_blocks=24, max_model_len=96,
                    kv_offload_disk_path=str(disk), kv_offload_disk_bytes="16MiB", **kw)


def _prompt(n: int = 40) -> list[int]:
    return [(i * 37) % 190 + 5 for i in range(n)]


def _run(llm, prompt):
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


@pytest.mark.parametrize("damage", ["wrong_size", "forged"])
def test_a_bad_object_on_disk_is_a_miss_after_a_restart(tiny_dirs, tmp_path, damage):
    """An engine saves a prompt to disk; every object there is replaced (a well-framed
    object of the wrong size, or a forged payload with a valid checksum); a new engine
    on the same directory (a restart) gives the same output as without offload,
    recomputing, and the bad objects are gone."""
    kw = {"kv_offload_hmac_key": KEY} if damage == "forged" else {}
    prompt = _prompt()
    reference, _ = _run(make_llm(tiny_dirs["llama"], num_kv_blocks=256), prompt)
    first = _disk_llm(tiny_dirs, tmp_path, **kw)
    assert _run(first, prompt)[0] == reference
    first.engine.offload.worker_side.drain()
    disk = first.engine.offload.stack.tier("disk")
    files = [disk.file_for(k) for k in disk.keys()]
    payload_bytes = first.engine.offload.layout.payload_bytes
    assert len(files) == (len(prompt) + GREEDY.max_tokens - 1) // 4  # prompt and output
    for f in files:
        key = bytes.fromhex(f.stem)
        if damage == "wrong_size":  # header, length and checksum agree: only the size is off
            data = ObjectCodec(payload_bytes // 2).encode(key, os.urandom(payload_bytes // 2))
        else:  # the right size and a valid checksum, written by someone without the key
            data = ObjectCodec(payload_bytes).encode(key, os.urandom(payload_bytes))
        f.write_bytes(data)
    del first
    again = _disk_llm(tiny_dirs, tmp_path, **kw)  # a restart: the index comes from the files
    stats = again.engine.offload.stack.stats["disk"]
    out, cached = _run(again, prompt)
    assert out == reference and cached == 0
    read = (len(prompt) - 1) // 4  # the load reads every block of the hit in one batch
    assert stats.corrupt == read and stats.tokens_loaded == 0
    assert again.engine.is_healthy
    # the bad objects read are gone: their blocks, recomputed, were saved again, checked
    again.engine.offload.worker_side.drain()
    codec = again.engine.offload.stack.codec

    def good(f) -> bool:
        try:
            return codec.decode(bytes.fromhex(f.stem), f.read_bytes(), authenticate=True) is not None
        except CorruptObjectError:
            return False
    assert sum(good(f) for f in files) == read
    assert _run(again, prompt[:-1] + [7])[0] and again.engine.is_healthy


def test_tagged_objects_load_across_a_restart(tiny_dirs, tmp_path):
    """With a MAC key the objects an engine saved carry tags a restarted engine with the
    same key accepts; one with another key refuses every object (and recomputes)."""
    prompt = _prompt()
    first = _disk_llm(tiny_dirs, tmp_path, kv_offload_hmac_key=KEY)
    reference, _ = _run(first, prompt)
    first.engine.offload.worker_side.drain()
    del first
    same = _disk_llm(tiny_dirs, tmp_path, kv_offload_hmac_key=KEY)
    out, cached = _run(same, prompt + [9])
    assert cached == len(prompt)
    assert same.engine.offload.stack.stats["disk"].tokens_loaded == cached
    assert _run(same, prompt)[0] == reference
    del same
    other = _disk_llm(tiny_dirs, tmp_path, kv_offload_hmac_key="a different key, 32 bytes long")
    out, cached = _run(other, prompt)
    assert out == reference and cached == 0
    assert other.engine.offload.stack.stats["disk"].corrupt == (len(prompt) - 1) // 4
