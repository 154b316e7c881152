#include <cstdint>

#include "gpu/copy_kernels.h"

namespace orbitkv::gpu {
namespace {

constexpr uint32_t kWarpLanes = 32;
// Words each lane has in flight in the body loop: enough independent loads per warp to cover the
// latency of reads across PCIe with the warps a modest grid has.
constexpr int kUnroll = 4;

// Streaming (evict-first) loads and stores: the bytes are touched once. Plain loads and stores
// with twice the words in flight, and Hopper's bulk copy unit driven by one lane per warp, measured
// no faster (docs/gpu.md).
template <typename T>
__device__ __forceinline__ T Load(const T* p) {
  return __ldcs(p);
}

template <typename T>
__device__ __forceinline__ void Store(T* p, T v) {
  __stcs(p, v);
}

// Copies `n` bytes with single bytes, one per lane per step (heads, tails).
__device__ __forceinline__ void WarpCopyBytes(const uint8_t* src, uint8_t* dst, uint64_t n, uint32_t lane) {
  for (uint64_t i = lane; i < n; i += kWarpLanes) dst[i] = src[i];
}

// Bytes from `dst` up to its first address aligned to `word` bytes, at most `n`.
__device__ __forceinline__ uint64_t HeadBytes(const uint8_t* dst, uint64_t word, uint64_t n) {
  const uint64_t head = (word - (reinterpret_cast<uintptr_t>(dst) & (word - 1))) & (word - 1);
  return head < n ? head : n;
}

// One warp copies `n` bytes from `src` to `dst`, whose addresses agree modulo sizeof(T): single
// bytes up to the first T-aligned destination address, T words for the body (kUnroll per lane in
// flight), single bytes for the tail. Every lane of the warp calls it with the same arguments.
template <typename T>
__device__ __forceinline__ void WarpCopy(const uint8_t* src, uint8_t* dst, uint64_t n, uint32_t lane) {
  constexpr uint64_t kWord = sizeof(T);
  const uint64_t head = HeadBytes(dst, kWord, n);
  WarpCopyBytes(src, dst, head, lane);
  src += head;
  dst += head;
  n -= head;
  const uint64_t words = n / kWord;
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  uint64_t i = lane;
  for (; i + kWarpLanes * (kUnroll - 1) < words; i += kWarpLanes * kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = Load(s + i + kWarpLanes * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) Store(d + i + kWarpLanes * u, v[u]);
  }
  for (; i < words; i += kWarpLanes) Store(d + i, Load(s + i));
  const uint64_t body = words * kWord;
  WarpCopyBytes(src + body, dst + body, n - body, lane);
}

// Picks the widest word both addresses are aligned to relative to each other.
__device__ __forceinline__ void WarpCopyAny(const uint8_t* src, uint8_t* dst, uint64_t n, uint32_t lane) {
  // The same branch for the whole warp: the chunk is warp-uniform.
  const uint64_t misalignment = (reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst)) & 15;
  if (misalignment == 0) {
    WarpCopy<uint4>(src, dst, n, lane);
  } else if ((misalignment & 7) == 0) {
    WarpCopy<unsigned long long>(src, dst, n, lane);
  } else if ((misalignment & 3) == 0) {
    WarpCopy<unsigned int>(src, dst, n, lane);
  } else if ((misalignment & 1) == 0) {
    WarpCopy<unsigned short>(src, dst, n, lane);
  } else {
    WarpCopy<unsigned char>(src, dst, n, lane);
  }
}

__global__ void __launch_bounds__(kCopyThreadsPerBlock)
    CopyChunksKernel(const CopyChunk* __restrict__ chunks, uint32_t count) {
  const uint32_t lane = threadIdx.x % kWarpLanes;
  const uint32_t warps = gridDim.x * kCopyWarpsPerBlock;
  for (uint32_t c = blockIdx.x * kCopyWarpsPerBlock + threadIdx.x / kWarpLanes; c < count; c += warps) {
    const CopyChunk chunk = chunks[c];
    WarpCopyAny(reinterpret_cast<const uint8_t*>(chunk.src), reinterpret_cast<uint8_t*>(chunk.dst), chunk.bytes, lane);
  }
}

}  // namespace

cudaError_t LaunchCopyChunks(const CopyChunk* device_chunks, uint32_t count, uint32_t blocks, cudaStream_t stream) {
  CopyChunksKernel<<<blocks, kCopyThreadsPerBlock, 0, stream>>>(device_chunks, count);
  return cudaGetLastError();
}

}  // namespace orbitkv::gpu
