// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// A fresh directory under the system temp dir for one checkpoint, removed afterwards.

#include <filesystem>
#include <string>
#include <system_error>

#include <unistd.h>

namespace harness {

struct scratch_dir {
  std::filesystem::path path;
  /// DIR/distopt-ckpt-PID-TAG-N, N counting up in this process (not created: a save creates it).
  explicit scratch_dir(const std::string& tag) {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           std::string("distopt-ckpt-").append(std::to_string(::getpid())).append("-").append(tag).append("-").append(
               std::to_string(counter++));
    std::filesystem::remove_all(path);
  }
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
};

}  // namespace harness
