"""The torch half of the GPU gate (tests/gpu/run_gate.sh): a bf16 KV tensor in THIS process's GPU memory, exported
exactly as orbitkv.client.CacheManagerClient.register_group exports a CUDA tensor (its _cuda_ipc helper, loaded from
python/orbitkv/client.py without the native module, which the GPU machine's Python cannot import), then saved and
restored through the Manager by gpu_ipc_engine (mode external) and compared here, every byte.

    python3 tests/gpu/torch_engine.py ENGINE_BINARY SOCKET
Prints one JSON line; exit 0 when every byte matched.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_client_helpers():
    """_is_cuda and _cuda_ipc from orbitkv/client.py, without importing the package (no _native here)."""
    tree = ast.parse((ROOT / "python/orbitkv/client.py").read_text())
    wanted = [node for node in tree.body
              if (isinstance(node, ast.FunctionDef) and node.name in ("_is_cuda", "_cuda_ipc"))
              or (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_CUDA_IPC_HANDLE_BYTES"
                                                       for t in node.targets))]
    namespace = {}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "client.py", "exec"), namespace)
    return namespace["_cuda_ipc"]


def main():
    engine, socket = sys.argv[1], sys.argv[2]
    cuda_ipc = load_client_helpers()
    pages, tokens, heads, dim = 256, 16, 8, 128
    # A tensor that starts inside a larger caching-allocator block: the IPC offset must account for it.
    block = torch.empty((pages + 3) * tokens * heads * dim, dtype=torch.bfloat16, device="cuda")
    kv = block[3 * tokens * heads * dim:].view(pages, tokens, heads, dim)
    kv.copy_(torch.randn(kv.shape, dtype=torch.float32, device="cuda").to(torch.bfloat16))
    torch.cuda.synchronize()
    original = kv.clone()
    handle, offset, bus_id = cuda_ipc(kv)
    page_bytes = kv[0].numel() * kv.element_size()
    proc = subprocess.Popen(
        [engine, "--socket", socket, "--mode", "external", "--instance", "77", "--pages", str(pages),
         "--ipc-handle", handle.hex(), "--ipc-offset", str(offset), "--pci-bus-id", bus_id,
         "--page-bytes", str(page_bytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, LD_LIBRARY_PATH=os.environ.get("ORBITKV_GATE_LIBRARY_PATH", "")))
    line = proc.stdout.readline().strip()
    if line != "saved":
        proc.kill()
        raise SystemExit(f"torch_engine: the engine did not save (said {line!r}, rc {proc.wait()})")
    kv.fill_(-7.0)  # poison
    torch.cuda.synchronize()
    proc.stdin.write("poisoned\n")
    proc.stdin.flush()
    line = proc.stdout.readline().strip()
    rc = proc.wait()
    if line != "restored" or rc != 0:
        raise SystemExit(f"torch_engine: the restore failed (said {line!r}, rc {rc})")
    torch.cuda.synchronize()
    half = pages // 2
    restored = kv[pages - half:].flip(0)  # key k went to page pages-1-k
    mismatched = int((restored.view(torch.int16) != original[:half].view(torch.int16)).sum())
    untouched = int((kv[:pages - half] != -7.0).sum())
    report = {"mode": "torch", "torch": torch.__version__, "pci_bus_id": bus_id, "ipc_offset": offset,
              "pages": pages, "page_bytes": page_bytes, "blocks": half,
              "bytes_compared": pages * page_bytes, "mismatched_values": mismatched,
              "poison_overwritten": untouched}
    print(json.dumps(report))
    return 0 if mismatched == 0 and untouched == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
