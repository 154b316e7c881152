"""A test-only reproduction of how vLLM (v1 engine, verified against upstream main of 2026-08) drives a KV
connector, so OrbitKVConnector can be tested the way vLLM will run it, without vLLM (not installable here).

    engine = Engine(vllm_config, lambda rank: SyntheticModel(4, tp_rank=rank), num_blocks=64)
    engine.add_request("r1", prompt, max_tokens=4)
    results = engine.run()

- request.py: vLLM-shaped ``Request`` with chained block hashes (sha256/pickle or sha256_cbor, seeded NONE_HASH).
- kv_cache_manager.py: one block pool for all groups, null block 0, prefix cache, sliding-window null blocks.
- scheduler.py: ``schedule()`` / ``update_from_output()`` with every connector call in vLLM's order, the
  WAITING_FOR_REMOTE_KVS state, preemption, abort, invalid-block recovery.
- worker.py: the model runner's connector sequence per step and the executor's KVOutputAggregator.
- models.py: vLLM-layout KV caches in ordinary memory (as vLLM allocates them) or OrbitKV shared memory; a
  synthetic checking model and the reference engine.
- engine.py: the EngineCore loop over one scheduler and TP x PP workers (pickled messages between them).
Faithfulness notes (what is simplified) are in each module's docstring.
"""
