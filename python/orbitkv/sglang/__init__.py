"""OrbitKV for SGLang.

- :class:`OrbitKVStorage`: a HiCache L3 storage backend, loaded with ``--hicache-storage-backend dynamic`` and
  ``--hicache-storage-backend-extra-config '{"backend_name":"orbitkv","module_path":"orbitkv.sglang",
  "class_name":"OrbitKVStorage","interface_v1":1}'``. Zero copy between
  the Manager and SGLang's host KV pool, SGLang's own (pinned) memory or OrbitKV shared memory.
- :class:`OrbitKVLinker`: an external-KV linker for SGLang's ``UnifiedRadixCache`` (no host tier), selected through
  the ``sglang.srt.plugins`` entry point ``orbitkv.sglang.plugin:register`` and ``--radix-cache-backend orbitkv``
  (needs an SGLang that can select an out-of-tree linker).

SGLang's own classes are used when SGLang is importable; otherwise same-named stand-ins keep this package
importable. See docs/sglang.md for every flag.
"""

from orbitkv.sglang._compat import HAVE_SGLANG, HAVE_SGLANG_LINKER  # noqa: F401
from orbitkv.sglang.hicache import OrbitKVStorage  # noqa: F401
from orbitkv.sglang.linker import OrbitKVLinker  # noqa: F401

__all__ = ["HAVE_SGLANG", "HAVE_SGLANG_LINKER", "OrbitKVLinker", "OrbitKVStorage"]
