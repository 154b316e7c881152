// Test-only: a fresh directory, removed with everything in it when the object goes (whether the
// test passed or not). Under /var/tmp by default, a real disk file system that accepts O_DIRECT
// (/tmp may be tmpfs).
#ifndef ORBITKV_BASE_TEMP_DIR_H_
#define ORBITKV_BASE_TEMP_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace orbitkv::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& parent = "/var/tmp", const std::string& prefix = "orbitkv_test") {
    std::string pattern = parent + "/" + prefix + ".XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Empty when the directory could not be created.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace orbitkv::testing

#endif  // ORBITKV_BASE_TEMP_DIR_H_
