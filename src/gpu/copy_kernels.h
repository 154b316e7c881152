// The batched gather/scatter kernel behind the CUDA copy engine.
//
// A batch is a list of CopyChunks, each a contiguous copy of at most the engine's chunk size
// between two device-visible addresses (device memory, or host memory mapped into the device's
// address space by HostMemoryRegistry). One launch copies every chunk of a batch: each warp takes
// chunks in turn (warp w copies chunks w, w + W, w + 2W, ... for W warps in the grid), and the 32
// lanes of a warp move the chunk in 16-byte vectors, four vectors per lane in flight. Addresses
// need no alignment: the widest word that source and destination share an alignment for (16, 8, 4,
// 2 or 1 bytes) carries the body, single bytes carry the unaligned head and tail.
//
// Chunks of one launch must not overlap each other's destinations (the copies run in any order).
//
// Thread safety: LaunchCopyChunks only enqueues work on `stream`; it may be called from any thread
// on which the stream's device is current.
#ifndef ORBITKV_GPU_COPY_KERNELS_H_
#define ORBITKV_GPU_COPY_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace orbitkv::gpu {

// One chunk as the kernel reads it. Laid out for 16-byte aligned arrays.
struct CopyChunk {
  uint64_t src = 0;    // Device-visible address of the first source byte.
  uint64_t dst = 0;    // Device-visible address of the first destination byte.
  uint64_t bytes = 0;  // At least 1.
  uint64_t reserved = 0;
};
static_assert(sizeof(CopyChunk) == 32, "CopyChunk is 32 bytes, two 16-byte loads");

// Threads per block of the copy kernel (8 warps).
inline constexpr uint32_t kCopyThreadsPerBlock = 256;
inline constexpr uint32_t kCopyWarpsPerBlock = kCopyThreadsPerBlock / 32;

// Enqueues one launch of `blocks` blocks on `stream` that copies `count` chunks read from
// `device_chunks` (`count` CopyChunks, 16-byte aligned, at a device-visible address: the engine
// passes mapped pinned host memory, which each warp reads once per chunk). Returns the launch
// error (cudaSuccess when the launch was queued; a fault during the copy surfaces later on the
// stream). `count` and `blocks` must be at least 1.
cudaError_t LaunchCopyChunks(const CopyChunk* device_chunks, uint32_t count, uint32_t blocks, cudaStream_t stream);

}  // namespace orbitkv::gpu

#endif  // ORBITKV_GPU_COPY_KERNELS_H_
