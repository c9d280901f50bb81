// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Reading and writing safetensors files (gradient traces now, checkpoints later).
///
/// Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header
/// length N, N bytes of UTF-8 JSON (an object mapping tensor names to
/// {"dtype","shape","data_offsets"}, plus an optional "__metadata__" object of strings),
/// then the data section, which the tensors must cover exactly, without overlaps or holes.
/// The reader validates all of that up front, so accessors never see a bad offset.
/// It is stricter than the Python/Rust reference (0.8), which accepts the first three of:
/// a header not starting with '{' (the format spec requires it), duplicate JSON keys
/// (nlohmann would keep the last silently), keys other than dtype/shape/data_offsets in a
/// tensor entry; like the reference it refuses headers over 100,000,000 bytes.
/// I/O uses POSIX calls (open, fsync, rename) because an atomic replace needs them.

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

/// A whole safetensors file held in memory, validated on open.
class safetensors_reader {
public:
  /// Reads and validates `path`. Throws format_error for malformed content and
  /// std::runtime_error (naming the path and errno text) if the file cannot be read.
  [[nodiscard]] static safetensors_reader open(const std::filesystem::path& path) {
    safetensors_reader r;
    r.path_ = path;
    r.file_ = detail::read_whole_file(path);
    r.file_size_ = r.file_.size();
    r.parse();
    return r;
  }

  /// Validates `bytes` as a whole safetensors file; `label` names it in messages (fuzzing,
  /// files already in memory).
  [[nodiscard]] static safetensors_reader from_bytes(std::vector<std::byte> bytes, std::string label) {
    safetensors_reader r;
    r.path_ = std::move(label);
    r.file_ = std::move(bytes);
    r.file_size_ = r.file_.size();
    r.parse();
    return r;
  }

  /// Reads only the length field and the header of `path` (plus its size) and validates
  /// them, including that the entries tile the data section the file size implies. The
  /// data is not read: bytes() and read_f32() refuse; read a tensor at data_start() +
  /// info(name).begin yourself (checkpoints read only the slices they need).
  [[nodiscard]] static safetensors_reader open_header(const std::filesystem::path& path) {
    auto [head, size] = read_header(path);
    return from_header(path, std::move(head), size);
  }

  /// The first bytes of `path` up to the end of its header (only the length field when
  /// that is out of range) and the file's size: what open_header validates, for callers
  /// that check a checksum of the raw bytes first.
  [[nodiscard]] static std::pair<std::vector<std::byte>, std::uint64_t> read_header(const std::filesystem::path& path) {
    const auto fail_io = [&](const char* what) {
      return std::runtime_error(path.string() + ": " + what + ": " + std::strerror(errno));
    };
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw fail_io("cannot open");
    struct closer {
      int fd;
      ~closer() { ::close(fd); }
    } guard{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw fail_io("cannot stat");
    const auto file_size = static_cast<std::uint64_t>(st.st_size);
    std::vector<std::byte> head;
    std::uint64_t header_size = 0;
    if (file_size >= 8) {
      if (!detail::read_at(fd, reinterpret_cast<std::byte*>(&header_size), 8, 0)) throw fail_io("cannot read");
      head.resize(8);
      if (header_size <= file_size - 8 && header_size <= max_header_size) {
        head.resize(static_cast<std::size_t>(8 + header_size));
        if (!detail::read_at(fd, head.data(), head.size(), 0)) throw fail_io("cannot read");
      } else {
        std::memcpy(head.data(), &header_size, 8);  // parse() reports the bad length
      }
    }
    return {std::move(head), file_size};
  }

  /// Validates what read_header returned (`label` names the file in messages).
  [[nodiscard]] static safetensors_reader from_header(std::filesystem::path label, std::vector<std::byte> head,
                                                      std::uint64_t file_size) {
    safetensors_reader r;
    r.path_ = std::move(label);
    r.header_only_ = true;
    r.file_size_ = file_size;
    r.file_ = std::move(head);
    r.parse();
    return r;
  }

  /// The length field and the JSON header, as in the file (what a checkpoint checksums).
  [[nodiscard]] std::span<const std::byte> header_bytes() const noexcept {
    return std::span<const std::byte>(file_).first(static_cast<std::size_t>(data_start_));
  }
  /// Offset of the data section from the start of the file.
  [[nodiscard]] std::uint64_t data_start() const noexcept { return data_start_; }
  /// Size of the whole file in bytes.
  [[nodiscard]] std::uint64_t file_size() const noexcept { return file_size_; }

  /// The path the file was opened from.
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

  /// The "__metadata__" object; empty if the file has none.
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept {
    return metadata_;
  }

  /// Tensor names in sorted order.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& [name, info] : tensors_) out.push_back(name);
    return out;
  }

  /// Whether the file holds a tensor called `name`.
  [[nodiscard]] bool contains(std::string_view name) const {
    return tensors_.find(name) != tensors_.end();
  }

  /// The header entry of `name`; format_error "missing tensor 'name'" if absent.
  [[nodiscard]] const tensor_info& info(std::string_view name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) fail("missing tensor '" + std::string(name) + "'");
    return it->second;
  }

  /// The raw little-endian bytes of `name` (no alignment guarantee; copy before reinterpreting).
  [[nodiscard]] std::span<const std::byte> bytes(std::string_view name) const {
    const tensor_info& t = info(name);
    if (header_only_) fail("tensor '" + t.name + "': the file was opened for its header only");
    return std::span<const std::byte>(file_).subspan(
        static_cast<std::size_t>(data_start_ + t.begin), static_cast<std::size_t>(t.end - t.begin));
  }

  /// `name` converted to float: F32, BF16 and F16 exactly; F64 rounded to nearest
  /// (values beyond float range become infinities). Other dtypes give format_error.
  [[nodiscard]] std::vector<float> read_f32(std::string_view name) const {
    const tensor_info& t = info(name);
    const auto raw = bytes(name);
    std::vector<float> out(static_cast<std::size_t>(t.numel()));
    if (t.dtype == "F32") {
      if (!out.empty()) std::memcpy(out.data(), raw.data(), raw.size());
    } else if (t.dtype == "BF16" || t.dtype == "F16") {
      const bool bf16 = t.dtype == "BF16";
      for (std::size_t i = 0; i < out.size(); ++i) {
        std::uint16_t bits = 0;
        std::memcpy(&bits, raw.data() + 2 * i, 2);
        out[i] = bf16 ? detail::bf16_bits_to_float(bits) : detail::f16_bits_to_float(bits);
      }
    } else if (t.dtype == "F64") {
      for (std::size_t i = 0; i < out.size(); ++i) {
        double v = 0;
        std::memcpy(&v, raw.data() + 8 * i, 8);
        out[i] = static_cast<float>(v);
      }
    } else {
      fail("tensor '" + t.name + "': read_f32 cannot convert dtype " + t.dtype +
           " (supported: F32, BF16, F16, F64)");
    }
    return out;
  }

private:
  /// Largest header the reference implementation accepts.
  static constexpr std::uint64_t max_header_size = 100'000'000;
  /// Deepest JSON nesting a header may have (about serde_json's limit of 128; a valid header
  /// nests 3 levels).
  static constexpr int max_json_depth = 128;

  safetensors_reader() = default;

  [[noreturn]] void fail(const std::string& what) const {
    throw format_error(path_.string() + ": " + what);
  }

  void parse() {
    const std::uint64_t file_size = file_size_;
    if (file_size < 8) {
      fail("file size " + std::to_string(file_size) +
           " is smaller than the 8-byte header length field");
    }
    std::uint64_t header_size = 0;
    if (file_.size() < 8) fail("cannot read the 8-byte header length field");
    std::memcpy(&header_size, file_.data(), 8);
    if (header_size > file_size - 8) {
      fail("header length " + std::to_string(header_size) + " exceeds file size " +
           std::to_string(file_size));
    }
    if (header_size > max_header_size) {
      fail("header length " + std::to_string(header_size) + " exceeds the limit of " +
           std::to_string(max_header_size) + " bytes");
    }
    data_start_ = 8 + header_size;
    const std::uint64_t data_size = file_size - data_start_;
    const char* text = reinterpret_cast<const char*>(file_.data()) + 8;
    if (header_size == 0 || text[0] != '{') {
      fail("header does not start with '{' (it must be a JSON object)");
    }

    const nlohmann::json header = parse_json(text, text + header_size);
    if (!header.is_object()) fail("header is not a JSON object");

    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        parse_metadata(value);
      } else {
        parse_entry(key, value, data_size);
      }
    }
    check_coverage(data_size);
  }

  // nlohmann keeps the last of duplicate keys, so a parser callback tracks the keys of
  // every open object (a set: a header may have millions) and records the first repeat.
  // It also refuses nesting deeper than max_json_depth, as the reference (serde_json) does:
  // nlohmann's dump() recurses, so a deeply nested value would overflow the stack.
  nlohmann::json parse_json(const char* first, const char* last) const {
    std::vector<std::set<std::string>> open_objects;
    std::optional<std::string> duplicate;
    const auto callback = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      using ev = nlohmann::json::parse_event_t;
      if (depth > max_json_depth) {
        fail("header nests JSON deeper than " + std::to_string(max_json_depth) + " levels");
      }
      if (event == ev::object_start) {
        open_objects.emplace_back();
      } else if (event == ev::object_end) {
        if (!open_objects.empty()) open_objects.pop_back();
      } else if (event == ev::key && !open_objects.empty()) {
        auto key = parsed.get<std::string>();
        if (!open_objects.back().insert(key).second && !duplicate) duplicate = std::move(key);
      }
      return true;
    };
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(first, last, callback);
    } catch (const nlohmann::json::exception& e) {
      fail(std::string("header is not valid JSON: ") + e.what());
    }
    if (duplicate) fail("duplicate key '" + *duplicate + "' in header");
    return header;
  }

  void parse_metadata(const nlohmann::json& value) {
    if (!value.is_object()) fail("'__metadata__' is not a JSON object");
    for (const auto& [key, v] : value.items()) {
      if (!v.is_string()) fail("'__metadata__' value of '" + key + "' is not a string");
      metadata_.emplace(key, v.get<std::string>());
    }
  }

  void parse_entry(const std::string& name, const nlohmann::json& entry, std::uint64_t data_size) {
    const std::string where = "tensor '" + name + "': ";
    if (!entry.is_object()) fail(where + "entry is not a JSON object");
    for (const auto& [key, v] : entry.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        fail(where + "unexpected key '" + key + "'");
      }
    }
    const auto field = [&](const char* key) -> const nlohmann::json& {
      const auto it = entry.find(key);
      if (it == entry.end()) fail(where + "missing '" + key + "'");
      return *it;
    };

    tensor_info t;
    t.name = name;
    const auto& dtype = field("dtype");
    if (!dtype.is_string()) fail(where + "'dtype' is not a string");
    t.dtype = dtype.get<std::string>();
    const auto element_size = dtype_size(t.dtype);
    if (!element_size) fail(where + "unknown dtype '" + t.dtype + "'");

    const auto& shape = field("shape");
    if (!shape.is_array()) fail(where + "'shape' is not an array");
    for (const auto& d : shape) {
      if (d.is_number_unsigned()) {
        const auto u = d.get<std::uint64_t>();
        if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          fail(where + "dimension " + std::to_string(u) + " is too large");
        }
        t.shape.push_back(static_cast<std::int64_t>(u));
      } else if (d.is_number_integer()) {
        fail(where + "negative dimension " + std::to_string(d.get<std::int64_t>()) +
             " in shape");
      } else {
        fail(where + "'shape' element " + d.dump() + " is not an integer");
      }
    }
    const auto expected = detail::byte_count(t.shape, *element_size);
    if (!expected) {
      fail(where + "size of dtype " + t.dtype + " and shape " + detail::shape_string(t.shape) +
           " overflows 64 bits");
    }

    const auto& offsets = field("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2) {
      fail(where + "'data_offsets' is not an array of two integers");
    }
    for (const auto& o : offsets) {
      if (o.is_number_unsigned()) continue;
      if (o.is_number_integer()) fail(where + "negative data offset " + o.dump());
      fail(where + "'data_offsets' element " + o.dump() + " is not an integer");
    }
    t.begin = offsets[0].get<std::uint64_t>();
    t.end = offsets[1].get<std::uint64_t>();
    if (t.begin > t.end) {
      fail(where + "data offsets " + detail::range_string(t.begin, t.end) +
           " are reversed (begin > end)");
    }
    if (t.end - t.begin != *expected) {
      fail(where + "data offsets " + detail::range_string(t.begin, t.end) +
           " do not match dtype " + t.dtype + " and shape " + detail::shape_string(t.shape) +
           " (" + std::to_string(*expected) + " bytes)");
    }
    if (t.end > data_size) {
      fail(where + "data offsets " + detail::range_string(t.begin, t.end) +
           " exceed the data section (" + std::to_string(data_size) + " bytes)");
    }
    tensors_.emplace(name, std::move(t));
  }

  // safetensors requires the tensors to tile the data section exactly.
  void check_coverage(std::uint64_t data_size) const {
    std::vector<const tensor_info*> order;
    order.reserve(tensors_.size());
    for (const auto& [name, t] : tensors_) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const tensor_info* a, const tensor_info* b) {
      return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
    });
    std::uint64_t covered = 0;
    const tensor_info* previous = nullptr;
    for (const tensor_info* t : order) {
      if (t->begin < covered) {
        fail("tensors '" + previous->name + "' " + detail::range_string(previous->begin, previous->end) +
             " and '" + t->name + "' " + detail::range_string(t->begin, t->end) + " overlap");
      }
      if (t->begin > covered) {
        fail("hole in the data section: bytes " + detail::range_string(covered, t->begin) +
             " belong to no tensor");
      }
      covered = t->end;
      previous = t;
    }
    if (covered != data_size) {
      fail("hole in the data section: bytes " + detail::range_string(covered, data_size) +
           " after the last tensor belong to no tensor");
    }
  }

  std::filesystem::path path_;
  std::vector<std::byte> file_;  // the whole file, or its first data_start_ bytes (header_only_)
  std::uint64_t file_size_ = 0;
  bool header_only_ = false;
  std::uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, tensor_info, std::less<>> tensors_;
};

/// Collects tensors (copying their bytes) and writes them as one safetensors file.
class safetensors_writer {
public:
  /// Sets (or replaces) a "__metadata__" entry.
  void set_metadata(std::string key, std::string value) {
    detail::require_json_string(key, "metadata key");
    detail::require_json_string(value, "metadata value");
    metadata_.insert_or_assign(std::move(key), std::move(value));
  }

  /// Adds a tensor of safetensors `dtype` and `shape` whose little-endian bytes are `data`.
  /// std::invalid_argument on a duplicate or reserved name, an unknown dtype, a negative
  /// dimension, or data.size() != numel * dtype size.
  void add(std::string name, std::string dtype, std::vector<std::int64_t> shape,
           std::span<const std::byte> data) {
    add_entry(std::move(name), std::move(dtype), std::move(shape), data, true);
  }

  /// add() without a copy: `data` must stay valid until write() returns.
  void add_view(std::string name, std::string dtype, std::vector<std::int64_t> shape,
                std::span<const std::byte> data) {
    add_entry(std::move(name), std::move(dtype), std::move(shape), data, false);
  }

  /// add() for float32 values.
  void add_f32(std::string name, std::vector<std::int64_t> shape, std::span<const float> values) {
    add(std::move(name), "F32", std::move(shape), std::as_bytes(values));
  }

  /// The 8-byte length field and the JSON header the file will start with.
  [[nodiscard]] std::string header() const {
    const std::string text = header_text();
    const std::uint64_t size = text.size();
    std::string out(8, '\0');
    std::memcpy(out.data(), &size, 8);
    return out + text;
  }

  /// Writes the file atomically: a temporary file in the target's directory, flushed and
  /// fsynced, then renamed over `path` (the directory is fsynced too, best effort).
  /// On failure the temporary file is removed and std::runtime_error names the path and
  /// the errno text; an existing file at `path` is then left untouched.
  void write(const std::filesystem::path& path) const { write(path, header()); }

  /// write() with the header() already made; returns the file's size in bytes.
  std::uint64_t write(const std::filesystem::path& path, const std::string& head) const {
    std::vector<std::span<const std::byte>> parts{std::as_bytes(std::span<const char>(head))};
    std::uint64_t size = head.size();
    for (const auto& [name, e] : tensors_) {
      parts.push_back(e.view);
      size += e.view.size();
    }
    detail::atomic_write(path, parts);
    return size;
  }

private:
  struct entry {
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> owned;     // add(): a copy
    std::span<const std::byte> view;  // what is written: the copy, or add_view()'s bytes
  };

  void add_entry(std::string name, std::string dtype, std::vector<std::int64_t> shape,
                 std::span<const std::byte> data, bool copy) {
    const std::string where = "safetensors_writer: tensor '" + name + "': ";
    if (name == "__metadata__") throw std::invalid_argument(where + "name is reserved");
    if (tensors_.contains(name)) throw std::invalid_argument(where + "duplicate name");
    detail::require_json_string(name, "tensor name");
    const auto element_size = dtype_size(dtype);
    if (!element_size) throw std::invalid_argument(where + "unknown dtype '" + dtype + "'");
    for (auto d : shape) {
      if (d < 0) throw std::invalid_argument(where + "negative dimension " + std::to_string(d));
    }
    const auto expected = detail::byte_count(shape, *element_size);
    if (!expected || *expected != data.size()) {
      throw std::invalid_argument(where + "dtype " + dtype + " and shape " +
                                  detail::shape_string(shape) + " need " +
                                  (expected ? std::to_string(*expected) : "too many") +
                                  " bytes, got " + std::to_string(data.size()));
    }
    auto& e = tensors_[std::move(name)];
    e.dtype = std::move(dtype);
    e.shape = std::move(shape);
    if (copy) {
      e.owned.assign(data.begin(), data.end());
      e.view = e.owned;
    } else {
      e.view = data;
    }
  }

  // Compact JSON as the reference writer emits it: "__metadata__" first, then tensors by
  // name with keys dtype, shape, data_offsets; spaces pad it to a multiple of 8 bytes.
  std::string header_text() const {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata_.empty()) {
      auto& meta = header["__metadata__"] = nlohmann::ordered_json::object();
      for (const auto& [key, value] : metadata_) meta[key] = value;
    }
    std::uint64_t offset = 0;
    for (const auto& [name, e] : tensors_) {
      nlohmann::ordered_json t = nlohmann::ordered_json::object();
      t["dtype"] = e.dtype;
      t["shape"] = e.shape;
      t["data_offsets"] = nlohmann::ordered_json::array({offset, offset + e.view.size()});
      offset += e.view.size();
      header[name] = std::move(t);
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    return text;
  }

  std::map<std::string, std::string> metadata_;
  std::map<std::string, entry> tensors_;
};

}  // namespace distopt::io
