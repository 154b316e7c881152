"""What OrbitKV's own demos, tests and benchmarks run an engine with; nothing vLLM or SGLang imports.

- ``orbitkv.demo.refengine``: the reference engine, a Llama-architecture model in PyTorch with paged KV caches (CPU or
  CUDA), with presets from "tiny" to Qwen3-8B-shaped;
- ``orbitkv.demo.sequential``: ``SequentialEngine``, the reference engine served the way vLLM's scheduler and model
  runner drive a KV connector (the stand-in the tests and benches use where vLLM cannot be installed);
- ``orbitkv.demo.chat``: the multi-turn chat of ``scripts/run`` (``python -m orbitkv.demo.chat --help``);
- ``orbitkv.demo.workload``: the Qwen3-8B-shaped page workload of ``scripts/run`` (``python -m orbitkv.demo.workload``).

The adapters engines load are ``orbitkv.vllm`` (``--kv-transfer-config``) and ``orbitkv.sglang``
(``--hicache-storage-backend dynamic``); they do not import this package.
"""
