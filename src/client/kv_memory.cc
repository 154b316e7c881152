#include "client/kv_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace orbitkv::client {

Result<ScopedFd> CreateKvMemory(const std::string& name, uint64_t bytes) {
  const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  ScopedFd fd(memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus("memfd_create", errno);
  if (ftruncate(fd.get(), static_cast<off_t>(rounded)) != 0) {
    return ErrnoStatus("ftruncate of the KV memfd", errno);
  }
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return ErrnoStatus("sealing the KV memfd", errno);
  }
  return fd;
}

}  // namespace orbitkv::client
