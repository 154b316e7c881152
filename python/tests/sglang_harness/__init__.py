"""Test-only harness reproducing how SGLang drives an L3 storage backend and an external cache linker (no SGLang
needed): SGLang-shaped host and device pools, HiRadixCache + HiCacheController storage threads, TP ranks as
threads, and a real orbitkv-manager process."""
