"""Test-only harness reproducing how SGLang drives an L3 storage backend and an external cache linker (no SGLang
needed): SGLang-shaped host and device pools in a HostPoolGroup, UnifiedRadixCache + HybridCacheController storage
threads (SGLang db570fe6, its default HiCache path), TP ranks as threads, and a real orbitkv-manager process."""
