"""The state library through orbitkv._native, cross-checked against an independent Python implementation of
the formats documented in docs/formats/state_key.md (hashlib + struct, no OrbitKV code)."""

import hashlib
import struct

import pytest

import orbitkv


def canonical_namespace(model_id, weights, tokenizer, engine, scope=b"", model_digest=bytes(32),
                        impl_digest=bytes(32), dtype=3, layout=1, layout_detail=b"", page=16,
                        tp=(1, 0), pp=(1, 0)):
    def field(tag, data):
        return bytes([tag]) + struct.pack("<I", len(data)) + data

    def u64(tag, value):
        return bytes([tag]) + struct.pack("<I", 8) + struct.pack("<Q", value)

    enc = b"orbitkv.namespace\0" + bytes([1])
    enc += field(1, model_id) + field(2, weights) + field(3, tokenizer) + field(4, engine) + field(5, scope)
    enc += field(6, model_digest) + field(7, impl_digest) + u64(8, dtype) + u64(9, layout)
    enc += field(10, layout_detail) + u64(11, page) + u64(12, tp[0]) + u64(13, tp[1])
    enc += u64(14, pp[0]) + u64(15, pp[1])
    return hashlib.sha256(enc).digest()


def encode_key(ns, group, begin, end, native, version=1):
    head = struct.pack("<BBHIQQ", 1, len(native), version, group, begin, end)
    return head + ns + native + bytes(64 - len(native)) + bytes(8)


NS_ARGS = ("Qwen/Qwen3-8B", "b968826d", "Qwen/Qwen3-8B@b968826d", "vllm")


@pytest.fixture
def ns():
    return orbitkv.derive_namespace(*NS_ARGS, tp_size=2, tp_rank=1)


def test_namespace_matches_documented_encoding():
    got = orbitkv.derive_namespace(*NS_ARGS, tp_size=2, tp_rank=1, layout_detail="NHD", dtype="fp16",
                                   page_size_tokens=32)
    want = canonical_namespace(*(a.encode() for a in NS_ARGS), tp=(2, 1), layout_detail=b"NHD", dtype=2, page=32)
    assert got == want


@pytest.mark.parametrize("change", [
    {"weights_revision": "other"}, {"tokenizer": "tok2"}, {"dtype": "fp8_e4m3"}, {"layout": "page_first"},
    {"tp_rank": 0}, {"page_size_tokens": 64}, {"cache_scope": "tenant"}, {"engine_kind": "sglang"},
])
def test_any_identity_change_changes_namespace(ns, change):
    args = dict(zip(("model_id", "weights_revision", "tokenizer", "engine_kind"), NS_ARGS))
    kwargs = {"tp_size": 2, "tp_rank": 1}
    for key, value in change.items():
        (args if key in args else kwargs)[key] = value
    assert orbitkv.derive_namespace(**args, **kwargs) != ns


def test_bad_identity_raises_typed_error():
    with pytest.raises(orbitkv.OrbitKVError) as info:
        orbitkv.derive_namespace("m", "w", "t", "e", tp_size=2, tp_rank=2)
    assert info.value.code == "INVALID_ARGUMENT"
    assert "tp_rank 2 >= tp_size 2" in str(info.value)
    with pytest.raises(ValueError):
        orbitkv.derive_namespace("m", "w", "t", "e", dtype="bf17")


def test_state_key_encoding_matches_documented_layout(ns):
    key = orbitkv.StateKey(ns, 2, 32, 48, b"\x01\x02\x03", key_version=7)
    assert key.encode() == encode_key(ns, 2, 32, 48, b"\x01\x02\x03", 7)
    assert len(key.encode()) == 128
    back = orbitkv.StateKey.decode(key.encode())
    assert back == key
    assert hash(back) == hash(key)
    assert (back.namespace, back.group, back.span, back.native_key, back.key_version) == (
        ns, 2, (32, 48), b"\x01\x02\x03", 7)


def test_state_key_decode_rejects_corruption(ns):
    good = bytearray(orbitkv.StateKey(ns, 0, 0, 16, b"abc").encode())
    for offset, value, code in [(0, 9, "FAILED_PRECONDITION"), (1, 0, "DATA_LOSS"), (100, 1, "DATA_LOSS")]:
        bad = bytearray(good)
        bad[offset] = value
        with pytest.raises(orbitkv.OrbitKVError) as info:
            orbitkv.StateKey.decode(bytes(bad))
        assert info.value.code == code
    with pytest.raises(orbitkv.OrbitKVError):
        orbitkv.StateKey.decode(bytes(good[:100]))


def test_shard_of_matches_documented_hash(ns):
    for i in range(64):
        key = orbitkv.StateKey(ns, 0, i * 16, i * 16 + 16, hashlib.sha256(bytes([i])).digest())
        digest = hashlib.sha256(b"orbitkv.shard.v1\0" + key.encode()).digest()
        prefix = int.from_bytes(digest[:8], "big")
        for n in (1, 16, 7):
            assert key.shard_of(n) == prefix % n


def test_recovery_contract_matches_original_api(ns):
    contract = orbitkv.RecoveryContract(ns, 16, [(0, "prefix", 0), (1, "window", 40), (2, "checkpoint", 0)])
    assert contract.required_ranges(ns, 0, 160) == [(0, 0, 160), (1, 112, 160), (2, 144, 160)]
    pages = list(range(10))
    boundaries = contract.restorable_boundaries(ns, 0, 160, [(0, pages), (1, pages), (2, [3, 7])])
    assert boundaries == [64, 128]
    other = contract.restorable_boundaries(ns, 0, 160, [(0, pages), (1, pages), (2, [7, 9])])
    assert orbitkv.intersect_boundaries([boundaries, other]) == [128]


def test_recovery_contract_errors(ns):
    with pytest.raises(orbitkv.OrbitKVError):
        orbitkv.RecoveryContract(ns, 16, [(0, "sideways", 0)])
    with pytest.raises(orbitkv.OrbitKVError):
        orbitkv.RecoveryContract(ns, 16, [(0, "window", 0)])
    contract = orbitkv.RecoveryContract(ns, 16, [(0, "prefix", 0)])
    with pytest.raises(orbitkv.OrbitKVError, match="not aligned"):
        contract.required_ranges(ns, 0, 17)
    other = orbitkv.derive_namespace("x", "w", "t", "e")
    with pytest.raises(orbitkv.OrbitKVError, match="does not match"):
        contract.required_ranges(other, 0, 16)
    with pytest.raises(orbitkv.OrbitKVError, match="does not declare"):
        contract.restorable_boundaries(ns, 0, 16, [(5, [0])])
    with pytest.raises(orbitkv.OrbitKVError, match="cannot have a window"):
        orbitkv.RecoveryContract(ns, 16, [(0, "prefix", 8)])
    with pytest.raises(orbitkv.OrbitKVError, match="32 bytes"):
        orbitkv.RecoveryContract(b"", 16, [(0, "prefix", 0)])
    with pytest.raises(orbitkv.OrbitKVError, match="32 bytes"):
        orbitkv.StateKey(b"short", 0, 0, 16, b"k")


def test_intersect_accepts_unsorted_input_and_keys_compare_with_anything(ns):
    assert orbitkv.intersect_boundaries([[64, 16, 32], [32, 64, 64]]) == [32, 64]
    key = orbitkv.StateKey(ns, 0, 0, 16, b"k")
    assert key != None  # noqa: E711  (must not raise TypeError)
    assert key != "k"
