"""The reference paged-attention engine: layouts, hashes, the math against a dense reference, and the property
OrbitKV rests on: restoring a prefix's KV bytes (into other block ids) gives bit-identical logits and tokens."""

import functools
import hashlib
import math

import pytest
import torch

from orbitkv.demo import refengine as rf
from orbitkv import shm

PROMPT = [(7 * i + 3) % 251 for i in range(160)]  # 10 blocks of 16; the last block is partial once decoding


def make(config="tiny", num_blocks=48, chunk_size=64, **kwargs):
    cfg = rf.preset(config) if isinstance(config, str) else config
    return rf.RefEngine(cfg, num_blocks, chunk_size=chunk_size, **kwargs)


# ---- config, layouts, allocation -------------------------------------------------------------------------------

def test_presets_and_config_errors():
    q = rf.preset("qwen3_8b_shaped")
    assert (q.num_layers, q.num_kv_heads, q.head_dim, q.hidden_size, q.num_heads) == (36, 8, 128, 4096, 32)
    assert q.dtype == "bfloat16" and q.torch_dtype == torch.bfloat16 and q.qk_norm
    assert 8.1e9 < q.num_parameters < 8.3e9
    assert q.page_bytes == 16 * 8 * 2 * 128 * 2  # 64 KiB per layer-block, as vLLM's Llama-3-8B example
    assert rf.preset("tiny", block_size=64).block_size == 64
    assert rf.preset("tiny").fingerprint() != rf.preset("tiny", seed=1).fingerprint()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        rf.preset("tiny", num_heads=3)
    with pytest.raises(ValueError, match="one entry per layer"):
        rf.preset("tiny", sliding_window=(8,))
    with pytest.raises(ValueError, match="dtype"):
        rf.preset("tiny", dtype="int8")
    with pytest.raises(ValueError, match="unknown preset"):
        rf.preset("huge")
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        rf.preset("tiny", layers=3)
    with pytest.raises(ValueError, match="chunk_size"):
        make(chunk_size=24)


@pytest.mark.parametrize("layout,shape", [("nhd", (48, 16, 2, 32)), ("hnd", (48, 2, 16, 32)),
                                          ("split", (2, 48, 16, 2, 16))])
def test_layouts_place_tokens_where_vllm_does(layout, shape):
    e = make(kv_layout=layout)
    c = e.config
    assert all(tuple(t.shape) == shape for t in e.cache.layers) and len(e.cache.layers) == c.num_layers
    assert list(e.cache.named_tensors()) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    pages = e.cache.page_tensors()
    assert len(pages) == c.num_layers * (2 if layout == "split" else 1)
    assert all(p.shape[0] == 48 and p[5].is_contiguous() for p in pages)
    assert sum(p[0].numel() * p.element_size() for p in pages) == e.cache.block_bytes == c.num_layers * c.page_bytes

    r = e.add_request(PROMPT[:40])
    e.prefill(r)
    # Position 37 sits in block_ids[2] at offset 5; K and V read back by position match the raw layout.
    b, off, d = r.block_ids[2], 5, c.head_dim
    k, v = e.cache.read_tokens(1, torch.tensor(r.block_ids), torch.tensor([37]))
    t = e.cache.layers[1]
    raw = {"nhd": lambda: (t[b, off, :, :d], t[b, off, :, d:]),
           "hnd": lambda: (t[b, :, off, :d], t[b, :, off, d:]),
           "split": lambda: (t[0, b, off], t[1, b, off])}[layout]()
    assert torch.equal(k[0], raw[0]) and torch.equal(v[0], raw[1])
    assert k.abs().sum() > 0 and not torch.equal(k, v)
    # Unwritten slots stay zero: the 40 tokens fill blocks 0-1 and 8 of the 16 slots of block 2.
    assert torch.count_nonzero(e.cache.read_tokens(0, torch.tensor(r.block_ids), torch.arange(40, 48))[0]) == 0


def test_token_reads_follow_a_block_table_changed_in_place():
    """A forward pass's slots are kept per (table, positions) tensor; a table or positions tensor changed in place
    is a new key, so a read never uses slots of the tensor's old contents."""
    e = make()
    r = e.add_request(PROMPT[:40])
    e.prefill(r)
    table, positions = torch.tensor(r.block_ids), torch.arange(0, 16)
    first_block = e.cache.read_tokens(1, table, positions)[0].clone()
    assert torch.equal(e.cache.read_tokens(1, table, positions)[0], first_block)  # the kept answer
    table[0] = r.block_ids[1]  # the same tensor object now maps positions 0-15 to the second block
    second_block = e.cache.read_tokens(1, torch.tensor(r.block_ids), torch.arange(16, 32))[0]
    assert not torch.equal(second_block, first_block)
    assert torch.equal(e.cache.read_tokens(1, table, positions)[0], second_block)
    positions += 16  # the same positions tensor now names block 1's tokens through table[1]
    table[0] = r.block_ids[0]
    assert torch.equal(e.cache.read_tokens(1, table, positions)[0], second_block)
    with torch.inference_mode():  # no version counters: computed each time
        assert torch.equal(e.cache.read_tokens(1, torch.tensor(r.block_ids), torch.arange(0, 16))[0], first_block)


def test_layouts_compute_the_same_values():
    base = make()
    runs = {}
    for layout in rf.KV_LAYOUTS:
        e = make(kv_layout=layout, model=base.model)
        runs[layout] = e.generate(e.add_request(PROMPT), 3)
    for layout, g in runs.items():
        assert g.tokens == runs["nhd"].tokens, layout
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g.logits, runs["nhd"].logits))


def test_kv_tensors_from_an_allocator_in_shared_memory_and_preallocated():
    e = make(kv_allocator=functools.partial(shm.empty, like="torch"))
    views = [shm.buffer_of(t) for t in e.cache.layers]
    assert len({id(v.buffer) for v in views}) == e.config.num_layers
    ref = make(model=e.model)
    assert e.generate(e.add_request(PROMPT), 2).tokens == ref.generate(ref.add_request(PROMPT), 2).tokens
    assert torch.count_nonzero(e.cache.layers[0]) > 0  # the KV really went into the shared buffers

    tensors = [torch.full(e.cache.layer_shape, float("nan")) for _ in range(e.config.num_layers)]
    pre = make(kv_tensors=tensors, model=e.model)
    assert pre.cache.layers[0] is tensors[0]
    assert pre.generate(pre.add_request(PROMPT), 2).tokens == ref.generate(ref.add_request(PROMPT), 2).tokens
    with pytest.raises(ValueError, match="layer 0 is"):
        make(kv_tensors=[torch.zeros(3)] * 2, model=e.model)
    with pytest.raises(ValueError, match="one per layer"):
        make(kv_tensors=tensors[:1], model=e.model)
    with pytest.raises(ValueError, match="not both"):
        make(kv_tensors=tensors, kv_allocator=torch.zeros, model=e.model)


def test_block_allocator():
    a = rf.BlockAllocator(4, order=[3, 1, 0, 2])
    assert a.allocate(2) == [3, 1] and a.num_free == 2
    with pytest.raises(rf.OutOfBlocks):
        a.allocate(3)
    a.free([1])
    assert a.allocate(3) == [0, 2, 1]
    with pytest.raises(ValueError, match="not allocated"):
        a.free([7])
    with pytest.raises(ValueError, match="permutation"):
        rf.BlockAllocator(3, order=[0, 0, 1])
    e = make(num_blocks=4)
    with pytest.raises(rf.OutOfBlocks):
        e.prefill(e.add_request(PROMPT[:80]))  # 5 blocks


def test_block_bytes_roundtrip_and_bad_input():
    for layout in rf.KV_LAYOUTS:
        e = make(kv_layout=layout)
        r = e.add_request(PROMPT[:64])
        e.prefill(r)
        data = e.cache.read_blocks(r.block_ids)
        assert len(data) == 4 * e.cache.block_bytes
        one_layer = e.cache.read_blocks(r.block_ids[1:2], layers=[1])
        assert one_layer == data[e.cache.block_bytes + e.cache.page_bytes:2 * e.cache.block_bytes]
        e.cache.write_blocks([40, 41, 42, 43], data)
        assert e.cache.read_blocks([40, 41, 42, 43]) == data
        with pytest.raises(ValueError, match="expected"):
            e.cache.write_blocks([40], data)
        with pytest.raises(ValueError, match="out of range"):
            e.cache.read_blocks([48])


# ---- hashes ----------------------------------------------------------------------------------------------------

def test_cbor_matches_rfc8949_vectors():
    vectors = [(0, "00"), (23, "17"), (24, "1818"), (100, "1864"), (1000, "1903e8"), (1000000, "1a000f4240"),
               (1000000000000, "1b000000e8d4a51000"), (-1, "20"), (-100, "3863"), (-1000, "3903e7"),
               (b"", "40"), (b"\x01\x02\x03\x04", "4401020304"), ("", "60"), ("a", "6161"),
               ("IETF", "6449455446"), ("\u00fc", "62c3bc"), ((), "80"), ((1, 2, 3), "83010203"),
               ((1, (2, 3), [4, 5]), "8301820203820405"), (None, "f6"), (True, "f5"), (False, "f4"),
               (tuple(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819")]
    for value, expected in vectors:
        assert rf.cbor_encode(value).hex() == expected, value
    with pytest.raises(TypeError):
        rf.cbor_encode(1.5)


def test_vllm_block_hash_chaining():
    bs = 16
    h = rf.vllm_block_hashes(PROMPT, bs)
    assert len(h) == 10 and all(isinstance(x, bytes) and len(x) == 32 for x in h) and len(set(h)) == 10
    # The first block by hand: SHA-256(CBOR [NONE_HASH, [16 token ids], null]).
    seed = hashlib.sha256(b"\x61" + b"0").digest()  # CBOR text "0"
    assert rf.none_hash("0") == seed
    first = b"\x83\x58\x20" + seed + b"\x90" + b"".join(rf.cbor_encode(t) for t in PROMPT[:16]) + b"\xf6"
    assert h[0] == hashlib.sha256(first).digest()
    # Same prefix -> same hashes; a partial last block is not hashed.
    assert rf.vllm_block_hashes(PROMPT[:100], bs) == h[:6]
    # One token changed in block 4 -> blocks 0-3 equal, every later hash differs.
    changed = list(PROMPT)
    changed[70] = (changed[70] + 1) % 251
    h2 = rf.vllm_block_hashes(changed, bs)
    assert h2[:4] == h[:4] and all(a != b for a, b in zip(h2[4:], h[4:]))
    # The seed, a LoRA and a cache salt change the whole chain; continuing from a parent equals one pass.
    assert not set(rf.vllm_block_hashes(PROMPT, bs, none_hash=rf.none_hash("1"))) & set(h)
    assert not set(rf.vllm_block_hashes(PROMPT, bs, lora_name="adapter")) & set(h)
    salted = rf.vllm_block_hashes(PROMPT, bs, cache_salt="tenant")
    assert not set(salted) & set(h)
    assert rf.vllm_block_hashes(PROMPT[64:], bs, parent=salted[3], first_block=4, cache_salt="tenant") == salted[4:]
    # vLLM puts cache_salt into block 0's extra keys only: later blocks chain like unsalted ones.
    assert rf.vllm_block_hashes(PROMPT[16:], bs, parent=salted[0], first_block=1) == salted[1:]
    with pytest.raises(ValueError, match="parent"):
        rf.vllm_block_hashes(PROMPT, bs, first_block=2)


def test_engine_request_hashes_follow_output_tokens():
    e = make()
    r = e.add_request(PROMPT[:30], cache_salt="s")
    assert r.block_hashes == rf.vllm_block_hashes(PROMPT[:30], 16, none_hash=e.none_hash, cache_salt="s")
    g = e.generate(r, 6)  # 36 tokens: block 1 completes at the 32nd token
    assert r.all_token_ids == PROMPT[:30] + g.tokens and r.num_computed_tokens == 35
    assert r.block_hashes == rf.vllm_block_hashes(r.all_token_ids, 16, none_hash=e.none_hash, cache_salt="s")
    assert len(r.block_hashes) == 2 and len(r.block_ids) == 3
    assert e.computed_full_blocks(r) == r.block_ids[:2]


def test_sglang_page_hashes():
    tokens = list(range(1000, 1200))
    pages = rf.sglang_page_hashes(tokens, 64)
    assert len(pages) == 3 and all(len(p) == 64 and p == p.lower() for p in pages)
    first = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens[:64])).hexdigest()
    assert pages[0] == first
    second = hashlib.sha256(bytes.fromhex(first) + b"".join(t.to_bytes(4, "little") for t in tokens[64:128]))
    assert pages[1] == second.hexdigest()
    assert rf.sglang_page_hashes(tokens[64:], 64, prior_hash=pages[0]) == pages[1:]
    in_vocab = [t % 256 for t in tokens]
    assert make().add_request(in_vocab).page_hashes() == rf.sglang_page_hashes(in_vocab, 64)
    with pytest.raises(ValueError, match="uint32"):
        rf.sglang_page_hashes([-1] * 64)


# ---- the math --------------------------------------------------------------------------------------------------

def dense_reference(model, tokens):
    """Test-only: the same transformer without a KV cache (full causal attention in float64), last logits."""
    c = model.config
    t = len(tokens)
    x = model.embed[torch.tensor(tokens)].double()
    pos = torch.arange(t, dtype=torch.float64)

    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w.double()

    def rope(v):
        half = c.head_dim // 2
        freq = c.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / c.head_dim)
        ang = pos[:, None, None] * freq
        a, b = v[..., :half], v[..., half:]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)

    for i, w in enumerate(model.layers):
        h = norm(x, w.input_norm) @ w.qkv.double().T
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = h[:, :nq].view(t, c.num_heads, c.head_dim)
        k = h[:, nq:nq + nkv].view(t, c.num_kv_heads, c.head_dim)
        v = h[:, nq + nkv:].view(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = norm(q, w.q_norm), norm(k, w.k_norm)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(c.q_per_kv, 1)
        v = v.repeat_interleave(c.q_per_kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        qi, ki = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = ki <= qi
        if c.window(i) is not None:
            allowed &= ki > qi - c.window(i)
        att = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        x = x + att.reshape(t, -1) @ w.o.double().T
        gate, up = (norm(x, w.post_norm) @ w.gate_up.double().T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w.down.double().T
    return (norm(x[-1:], model.final_norm) @ model.lm_head.double().T)[0]


@pytest.mark.parametrize("config", ["tiny", "tiny_hybrid", "tiny_qk_norm"])
@pytest.mark.parametrize("chunk_size", [16, 64, 256])
def test_paged_chunked_prefill_matches_dense_attention(config, chunk_size):
    cfg = rf.preset("tiny", qk_norm=True) if config == "tiny_qk_norm" else rf.preset(config)
    e = make(cfg, chunk_size=chunk_size, block_order=list(range(47, -1, -1)))
    logits = e.prefill(e.add_request(PROMPT))
    expected = dense_reference(e.model, PROMPT)
    assert torch.allclose(logits.double(), expected, atol=2e-4, rtol=1e-4), (logits.double() - expected).abs().max()


def test_runs_are_deterministic_and_the_seed_matters():
    a, b = make(), make()
    ga, gb = a.generate(a.add_request(PROMPT), 4), b.generate(b.add_request(PROMPT), 4)
    assert ga.tokens == gb.tokens and all(torch.equal(x, y) for x, y in zip(ga.logits, gb.logits))
    assert all(torch.equal(x, y) for x, y in zip(a.cache.layers, b.cache.layers))
    c = make(rf.preset("tiny", seed=1))
    assert not torch.equal(c.prefill(c.add_request(PROMPT)), ga.logits[0])


# ---- restored prefix == recomputed prefix, bit for bit ---------------------------------------------------------

@pytest.mark.parametrize("layout", rf.KV_LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_restored_prefix_gives_bit_identical_logits_and_tokens(layout, dtype):
    cfg = rf.preset("tiny", dtype=dtype, qk_norm=(dtype == "bfloat16"))
    n_cached = 128  # 8 blocks, two 64-token chunks: the suffix [128, 160) is chunked the same in both runs
    full = make(cfg, kv_layout=layout)
    r1 = full.add_request(PROMPT)
    g1 = full.generate(r1, 5)
    saved = full.cache.read_blocks(r1.block_ids[:8])

    # A fresh engine (same seed) whose free list is reversed, every slot NaN so an unrestored read would show.
    fresh = make(cfg, kv_layout=layout, block_order=list(range(47, -1, -1)))
    for t in fresh.cache.layers:
        t.fill_(float("nan"))
    r2 = fresh.add_request(PROMPT)
    fresh.allocate(r2)
    assert not set(r2.block_ids[:8]) & set(r1.block_ids[:8])
    fresh.cache.write_blocks(r2.block_ids[:8], saved)
    g2 = fresh.generate(r2, 5, start_token=n_cached)
    assert g2.tokens == g1.tokens
    assert all(torch.equal(x, y) for x, y in zip(g1.logits, g2.logits))
    assert fresh.cache.read_blocks(r2.block_ids[:10]) == full.cache.read_blocks(r1.block_ids[:10])

    # Control: a wrong prefix (zeros) changes the logits, so the restored bytes really are read.
    wrong = make(cfg, kv_layout=layout, model=fresh.model)
    r3 = wrong.add_request(PROMPT)
    wrong.allocate(r3)
    assert not torch.equal(wrong.prefill(r3, start_token=n_cached), g1.logits[0])


def test_prefill_chunks_end_on_absolute_multiples_of_chunk_size():
    e = make(chunk_size=64)
    sizes = []
    forward = e.forward
    e.forward = lambda request, n: sizes.append(n) or forward(request, n)
    r = e.add_request(PROMPT)
    e.allocate(r)
    e.prefill(r, start_token=48)
    assert sizes == [16, 64, 32] and r.num_computed_tokens == 160
    sizes.clear()
    e.prefill(r, start_token=0, chunk_size=128)
    assert sizes == [128, 32]


def test_restore_via_copy_blocks_and_different_chunking_of_the_prefix():
    # The prefix's KV was computed in 32-token chunks by another request with another suffix; the full run also
    # uses 32-token chunks for [0, 128) and one chunk for the rest, so the schedules coincide.
    donor = make(chunk_size=32)
    rd = donor.add_request(PROMPT[:128] + [5] * 40)
    donor.prefill(rd)
    full = make(chunk_size=32, model=donor.model)
    r1 = full.add_request(PROMPT)
    l1 = full.prefill(r1, chunk_size=32)

    target = make(chunk_size=32, model=donor.model, block_order=list(range(20, 48)) + list(range(20)))
    r2 = target.add_request(PROMPT)
    target.allocate(r2)
    target.cache.copy_blocks_from(donor.cache, rd.block_ids[:8], r2.block_ids[:8])
    assert torch.equal(target.prefill(r2, start_token=128, chunk_size=32), l1)
    assert torch.equal(target.decode(_append(target, r2, 9)), full.decode(_append(full, r1, 9)))


def _append(engine, request, token):
    engine.append_token(request, token)
    return request


def test_needed_block_range():
    cfg = rf.preset("tiny", sliding_window=(34, None))
    assert list(cfg.needed_block_range(1, 128)) == list(range(8))
    assert list(cfg.needed_block_range(1, 120)) == list(range(8))  # a partial last block is needed too
    assert list(cfg.needed_block_range(0, 128)) == [5, 6, 7]  # position 95 = 128 - 34 + 1 is in block 5
    assert list(rf.preset("tiny", sliding_window=(33, None)).needed_block_range(0, 128)) == [6, 7]  # from 96
    assert list(rf.preset("tiny", sliding_window=(1, None)).needed_block_range(0, 128)) == []
    assert list(rf.preset("tiny", sliding_window=(500, None)).needed_block_range(0, 128)) == list(range(8))
    assert list(cfg.needed_block_range(0, 0)) == []
    with pytest.raises(ValueError):
        cfg.needed_block_range(0, -1)


@pytest.mark.parametrize("window,first_needed", [(32, 6), (34, 5)])
def test_hybrid_swa_restores_only_the_window(window, first_needed):
    cfg = rf.preset("tiny_hybrid", sliding_window=(window, None, window, None))  # layers 1 and 3 full
    n_cached = 128
    e = make(cfg)
    req = e.required_blocks(n_cached)
    assert req[1] == req[3] == list(range(8))
    assert req[0] == req[2] == list(range(first_needed, 8))
    assert rf.prefix_kv_bytes(cfg, n_cached) == (8 + 8 + 2 * (8 - first_needed)) * cfg.page_bytes

    full = make(cfg)
    r1 = full.add_request(PROMPT)
    g1 = full.generate(r1, 4)

    def restore_window(poison_block=None):
        eng = make(cfg, model=full.model, block_order=list(range(47, -1, -1)))
        for t in eng.cache.layers:
            t.fill_(float("nan"))
        r = eng.add_request(PROMPT)
        eng.allocate(r)
        for layer, logical in eng.required_blocks(n_cached).items():
            if poison_block is not None and cfg.window(layer) is not None:
                logical = [j for j in logical if j != poison_block]
            src = [r1.block_ids[j] for j in logical]
            eng.cache.write_blocks([r.block_ids[j] for j in logical], full.cache.read_blocks(src, [layer]), [layer])
        return eng, r

    eng, r2 = restore_window()
    g2 = eng.generate(r2, 4, start_token=n_cached)
    assert g2.tokens == g1.tokens and all(torch.equal(x, y) for x, y in zip(g1.logits, g2.logits))
    # Blocks before the window in the sliding-window layers are still NaN and were never read.
    assert torch.isnan(eng.cache.layers[0][r2.block_ids[first_needed - 1]]).all()
    # Control: leave the window's first block unrestored -> NaN reaches the logits.
    eng, r3 = restore_window(poison_block=first_needed)
    assert torch.isnan(eng.prefill(r3, start_token=n_cached)).any()


# ---- SGLang-style host pool, timing, bad input -----------------------------------------------------------------

@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_sglang_host_pool_pages_restore_bit_identically(layout):
    cfg = rf.preset("tiny", block_size=64)
    full = make(cfg, num_blocks=8, chunk_size=64)
    r1 = full.add_request(PROMPT)
    l1 = full.prefill(r1)
    pool = rf.HostKVPool(cfg, 6, layout=layout, allocator=functools.partial(shm.empty, like="torch"))
    pool.backup(full.cache, r1.block_ids[:2], [4, 1])
    k, v = pool.page_blobs(4)
    assert k.numel() == v.numel() == pool.blob_bytes == cfg.num_layers * 64 * 2 * 16 * 4
    assert k.is_contiguous() and shm.buffer_of(k).buffer is shm.buffer_of(pool.kv_buffer).buffer
    # Token 5 of page 4 in layer 1: K values as the engine computed them.
    k_tok, _ = full.cache.read_tokens(1, torch.tensor(r1.block_ids), torch.tensor([5]))
    inner = pool.kv_buffer[0, 4 * 64 + 5, 1] if layout == "page_first" else pool.kv_buffer[0, 4, 1, 5]
    assert torch.equal(inner, k_tok[0])

    fresh = make(cfg, num_blocks=8, chunk_size=64, model=full.model, block_order=[7, 6, 5, 4, 3, 2, 1, 0])
    r2 = fresh.add_request(PROMPT)
    fresh.allocate(r2)
    pool.load_back(fresh.cache, [4, 1], r2.block_ids[:2])
    assert torch.equal(fresh.prefill(r2, start_token=128), l1)
    with pytest.raises(ValueError, match="page size"):
        pool.backup(make().cache, [0], [0])

    # The HostKVCache view an SGLang backend gets: two registered buffers, pointers of whole pages.
    assert (pool.page_num, pool.size, pool.layer_num, pool.head_num, pool.head_dim) == (6, 384, 2, 2, 16)
    k_buf, v_buf = pool.get_hybrid_pool_buffer()
    assert k_buf.data_ptr() == pool.kv_buffer.data_ptr() and v_buf.shape == k_buf.shape
    assert k_buf.shape[0] == (pool.size if layout == "page_first" else pool.page_num)
    assert pool.get_size_per_token() * 64 == 2 * pool.blob_bytes
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(64, 128).tolist() + torch.arange(256, 320).tolist())
    assert ptrs == [pool.page_blobs(p)[i].data_ptr() for p in (1, 4) for i in (0, 1)]
    assert sizes == [pool.blob_bytes] * 4
    assert ptrs[1] - ptrs[0] == v_buf.data_ptr() - k_buf.data_ptr()
    with pytest.raises(ValueError, match="whole"):
        pool.get_page_buffer_meta(list(range(10)))


def test_split_layout_exposes_sglang_device_buffers():
    e = make(kv_layout="split")
    r = e.add_request(PROMPT[:40])
    e.prefill(r)
    k_buf, v_buf = e.cache.sglang_device_buffers()
    assert len(k_buf) == 2 and tuple(k_buf[0].shape) == (48 * 16, 2, 16)
    slot = r.block_ids[2] * 16 + 5  # token 37
    k, v = e.cache.read_tokens(1, torch.tensor(r.block_ids), torch.tensor([37]))
    assert torch.equal(k_buf[1][slot], k[0]) and torch.equal(v_buf[1][slot], v[0])
    with pytest.raises(ValueError, match="split"):
        make().cache.sglang_device_buffers()


def test_time_to_first_token_helper():
    e = make()
    reference = e.generate(e.add_request(PROMPT), 1).tokens[0]
    donor = e.add_request(PROMPT)
    e.prefill(donor)
    saved = e.cache.read_blocks(donor.block_ids[:8])
    restored = rf.time_to_first_token(e, PROMPT, cached_tokens=128,
                                      restore=lambda r: e.cache.write_blocks(r.block_ids[:8], saved))
    cold = rf.time_to_first_token(e, PROMPT)
    assert restored.first_token == cold.first_token == reference
    assert torch.equal(restored.logits, cold.logits)
    assert restored.ttft_s >= restored.restore_s > 0 and cold.restore_s == 0
    assert restored.request.block_ids == []  # freed
    with pytest.raises(ValueError, match="restore callback"):
        rf.time_to_first_token(e, PROMPT, cached_tokens=128)


def test_bad_input_is_rejected_clearly():
    e = make()
    with pytest.raises(ValueError, match="at least one token"):
        e.add_request([])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        e.add_request([1, 256])
    r = e.add_request(PROMPT[:40])
    with pytest.raises(ValueError, match="last token is always computed"):
        e.prefill(r, start_token=40)
    with pytest.raises(ValueError, match="exactly one uncomputed token"):
        e.decode(r)
    with pytest.raises(ValueError, match="cannot compute"):
        e.forward(r, 41)
    with pytest.raises(ValueError, match="chunk_size"):
        e.prefill(r, chunk_size=10)
    with pytest.raises(ValueError, match="outside"):
        e.append_token(r, -1)
    with pytest.raises(ValueError, match="kv_layout"):
        make(kv_layout="page_first")


def _tp_generate(config, prompt, tp):
    """Every rank of a TP=tp RefEngine generates the prompt at once, one thread per rank; -> (outputs, group)."""
    group = rf.ThreadTPGroup(tp, timeout_s=30)

    def rank(r):
        model = rf.Transformer(config, tp_rank=r, tp_size=tp, all_reduce=group.reducer(r))
        engine = rf.RefEngine(config, 16, model=model)
        assert engine.cache.layers[0].shape[-2] == config.num_kv_heads // tp  # nhd: the rank's KV heads
        return engine.generate(engine.add_request(prompt), 3)

    return group.run(rank, timeout_s=60), group


def test_tensor_parallel_ranks_compute_the_same_model():
    config = rf.preset("small")
    prompt = list(range(3, 70))
    whole = rf.RefEngine(config, 16)
    want = whole.generate(whole.add_request(prompt), 3)
    got, _ = _tp_generate(config, prompt, 2)
    assert got[0].tokens == got[1].tokens == want.tokens
    for a, b, w in zip(got[0].logits, got[1].logits, want.logits):
        assert torch.equal(a, b)  # every rank holds the same all-reduced result
        assert torch.allclose(a, w, atol=1e-4, rtol=1e-4)  # the same model as one rank, up to rounding
    again, _ = _tp_generate(config, prompt, 2)
    assert all(torch.equal(a, b) for a, b in zip(again[0].logits, got[0].logits))  # deterministic


def test_tensor_parallel_shape_errors_and_a_failed_rank_breaks_the_group():
    config = rf.preset("small")  # 8 heads, 2 KV heads
    with pytest.raises(ValueError, match="num_kv_heads .* multiple of tp_size"):
        rf.Transformer(config, tp_rank=0, tp_size=4, all_reduce=lambda t: t)
    with pytest.raises(ValueError, match="needs an all_reduce"):
        rf.Transformer(config, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="tp_rank"):
        rf.Transformer(config, tp_rank=2, tp_size=2, all_reduce=lambda t: t)
    group = rf.ThreadTPGroup(2, timeout_s=30)

    def rank(r):
        model = rf.Transformer(config, tp_rank=r, tp_size=2, all_reduce=group.reducer(r))
        engine = rf.RefEngine(config, 16, model=model)
        if r == 1:
            raise RuntimeError("rank failed")
        return engine.generate(engine.add_request(list(range(40))), 3)

    with pytest.raises(RuntimeError, match="rank failed"):
        group.run(rank, timeout_s=60)
    import threading

    assert any(isinstance(e, threading.BrokenBarrierError) for e in group.errors)  # rank 0 stopped waiting
