// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file What the safetensors reader and writer share (io/safetensors.hpp describes the
/// format): the format error, a tensor's header entry, shape and byte arithmetic, the
/// half-precision conversions, and the POSIX file calls of whole reads and atomic writes.

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

namespace distopt::io {

// The format is little-endian and the reader hands out the file's bytes as they are.
static_assert(std::endian::native == std::endian::little,
              "distopt::io::safetensors assumes a little-endian host");

/// A file that is not valid safetensors; what() names the file and the exact problem.
class format_error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

/// Bytes per element of a safetensors dtype string ("F32" -> 4), or nullopt if unknown.
/// Knows the byte-sized standard set; the sub-byte types (F4, F6_*) are not supported.
[[nodiscard]] constexpr std::optional<std::size_t> dtype_size(std::string_view dtype) noexcept {
  constexpr std::array<std::pair<std::string_view, std::size_t>, 17> table{{
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
      {"U16", 2},  {"I16", 2}, {"F16", 2}, {"BF16", 2},    {"U32", 4},     {"I32", 4},
      {"F32", 4},  {"U64", 8}, {"I64", 8}, {"F64", 8},     {"C64", 8},
  }};
  for (const auto& [name, size] : table) {
    if (name == dtype) return size;
  }
  return std::nullopt;
}

/// One tensor entry of a safetensors header; begin/end are relative to the data section.
struct tensor_info {
  std::string name;                 ///< key in the header
  std::string dtype;                ///< safetensors dtype string, e.g. "F32", "BF16"
  std::vector<std::int64_t> shape;  ///< dimensions; empty for a scalar
  std::uint64_t begin = 0;          ///< first byte, relative to the data section
  std::uint64_t end = 0;            ///< one past the last byte

  /// Number of elements (1 for a scalar). The reader has checked it does not overflow.
  [[nodiscard]] std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

namespace detail {

/// "[2, 3]" for error messages.
inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

inline std::string range_string(std::uint64_t begin, std::uint64_t end) {
  // Appending (not `"[" + std::to_string(..)`) avoids a GCC 12 -Wrestrict false positive.
  std::string s = "[";
  s += std::to_string(begin);
  s += ", ";
  s += std::to_string(end);
  s += ')';
  return s;
}

/// numel * element size in bytes, or nullopt on 64-bit overflow. Like the reference
/// implementation, a product that overflows before a later zero dimension is an error.
inline std::optional<std::uint64_t> byte_count(const std::vector<std::int64_t>& shape,
                                               std::size_t element_size) {
  constexpr auto max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t n = 1;
  for (auto d : shape) {
    const auto u = static_cast<std::uint64_t>(d);
    if (u != 0 && n > max / u) return std::nullopt;
    n *= u;
  }
  if (n > std::numeric_limits<std::uint64_t>::max() / element_size) return std::nullopt;
  return n * element_size;
}

/// Exact bfloat16 -> float: bfloat16 is the upper half of a binary32.
inline float bf16_bits_to_float(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

/// Exact IEEE binary16 -> float, including subnormals, infinities and NaN payloads.
inline float f16_bits_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  std::uint32_t exponent = (bits >> 10) & 0x1fu;
  std::uint32_t mantissa = bits & 0x3ffu;
  std::uint32_t out = 0;
  if (exponent == 0x1fu) {
    out = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    out = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    out = sign;
  } else {
    // Subnormal: value = mantissa * 2^-24; normalise so the leading 1 sits at bit 10.
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3ffu;
    exponent = static_cast<std::uint32_t>(127 - 15 + 1 - shift);
    out = sign | (exponent << 23) | (mantissa << 13);
  }
  return std::bit_cast<float>(out);
}

/// Whole file as bytes; std::runtime_error naming the path and errno text on failure.
inline std::vector<std::byte> read_whole_file(const std::filesystem::path& path) {
  const auto fail = [&](const char* what) {
    return std::runtime_error(path.string() + ": " + what + ": " + std::strerror(errno));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw fail("cannot open");
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw fail("cannot stat");
  std::vector<std::byte> bytes(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw fail("cannot read");
    }
    if (n == 0) break;  // shrank while we read; validation reports what is missing
    done += static_cast<std::size_t>(n);
  }
  bytes.resize(done);
  return bytes;
}

/// Reads exactly `size` bytes at `offset`, retrying short reads and EINTR; false with errno
/// set on an error, and with errno = 0 when the file ends first.
inline bool read_at(int fd, std::byte* out, std::size_t size, std::uint64_t offset) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, out, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (n == 0) {
      errno = 0;
      return false;
    }
    out += n;
    size -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
  return true;
}

/// Writes all of [data, data + size), retrying short writes and EINTR; false with errno set.
inline bool write_all(int fd, const std::byte* data, std::size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

/// Replaces `path` atomically with the concatenation of `parts`: a temporary file in the
/// same directory (".NAME.tmp-PID-RANDOM"), written, fsynced, closed and renamed over
/// `path`; then the directory is fsynced (best effort). On failure the temporary file is
/// removed, `path` is untouched, and std::runtime_error names the path and errno text.
inline void atomic_write(const std::filesystem::path& path, std::span<const std::span<const std::byte>> parts) {
  const std::filesystem::path dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  const auto fail = [&](const std::string& what) {
    return std::runtime_error(path.string() + ": " + what + ": " + std::strerror(errno));
  };
  // Own unique name instead of mkstemp so the file gets the usual 0666 & ~umask mode.
  std::random_device entropy;
  std::filesystem::path tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    std::string name = ".";
    name += path.filename().string();
    name += ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(entropy());
    tmp = dir / name;
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) throw fail("cannot create temporary file in '" + dir.string() + "'");
  const auto abandon = [&](const std::string& what) {
    const int saved = errno;
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    errno = saved;
    return fail(what + " '" + tmp.string() + "'");
  };
  for (const auto part : parts)
    if (!write_all(fd, part.data(), part.size())) throw abandon("cannot write temporary file");
  if (::fsync(fd) != 0) throw abandon("cannot fsync temporary file");
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0) throw abandon("cannot close temporary file");
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw abandon("cannot rename temporary file");
  // Make the rename itself durable; the new file is already in place, so errors are ignored.
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    (void)::fsync(dir_fd);
    ::close(dir_fd);
  }
}

/// Throws std::invalid_argument if `text` cannot be stored as a JSON string (bad UTF-8).
inline void require_json_string(const std::string& text, const char* what) {
  try {
    (void)nlohmann::json(text).dump();
  } catch (const nlohmann::json::exception&) {
    throw std::invalid_argument(std::string("safetensors_writer: ") + what +
                                " is not valid UTF-8");
  }
}

}  // namespace detail

}  // namespace distopt::io
