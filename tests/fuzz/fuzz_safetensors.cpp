// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// libFuzzer target: safetensors_reader::from_bytes on arbitrary bytes. Refusing the input
// with format_error is fine; any other exception, a crash or a sanitizer report is a bug.
// An accepted file must keep the reader's promises: every tensor lies in the data section,
// the tensors tile it, bytes() and read_f32() stay in bounds; and the header-only reader
// (what checkpoints use: read_header + from_header) must accept exactly the same files.
#include <distopt/io/safetensors.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_check.hpp"

namespace io = distopt::io;

namespace {

/// What safetensors_reader::read_header returns for a file holding `bytes`.
std::vector<std::byte> header_part(const std::vector<std::byte>& bytes) {
  if (bytes.size() < 8) return {};
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const std::uint64_t size = bytes.size();
  const std::size_t keep = n <= size - 8 && n <= 100'000'000 ? static_cast<std::size_t>(8 + n) : 8;
  return {bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(keep)};
}

void check_accepted(const io::safetensors_reader& r, std::size_t size) {
  FUZZ_CHECK(r.file_size() == size);
  FUZZ_CHECK(r.data_start() >= 8 && r.data_start() <= size);
  FUZZ_CHECK(r.header_bytes().size() == r.data_start());
  const std::uint64_t data_size = size - r.data_start();
  std::uint64_t covered = 0;
  for (const auto& name : r.names()) {
    FUZZ_CHECK(r.contains(name));
    const io::tensor_info& t = r.info(name);
    FUZZ_CHECK(t.name == name);
    FUZZ_CHECK(t.begin <= t.end && t.end <= data_size);
    const auto element = io::dtype_size(t.dtype);
    FUZZ_CHECK(element.has_value());
    for (auto d : t.shape) FUZZ_CHECK(d >= 0);
    const auto expected = io::detail::byte_count(t.shape, *element);
    FUZZ_CHECK(expected && *expected == t.end - t.begin);
    FUZZ_CHECK(static_cast<std::uint64_t>(t.numel()) * *element == t.end - t.begin);
    const auto raw = r.bytes(name);
    FUZZ_CHECK(raw.size() == t.end - t.begin);
    covered += raw.size();
    if (t.dtype == "F32" || t.dtype == "BF16" || t.dtype == "F16" || t.dtype == "F64") {
      const auto values = r.read_f32(name);
      FUZZ_CHECK(values.size() == static_cast<std::size_t>(t.numel()));
    }
  }
  FUZZ_CHECK(covered == data_size);  // the tensors tile the data section
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto* first = reinterpret_cast<const std::byte*>(data);
  std::vector<std::byte> bytes(first, first + size);
  auto head = header_part(bytes);

  bool accepted = false;
  try {
    const auto r = io::safetensors_reader::from_bytes(std::move(bytes), "fuzz");
    check_accepted(r, size);
    accepted = true;
  } catch (const io::format_error&) {
  }

  bool header_accepted = false;
  try {
    const auto r = io::safetensors_reader::from_header("fuzz", std::move(head), size);
    FUZZ_CHECK(r.file_size() == size && r.header_bytes().size() == r.data_start());
    header_accepted = true;
  } catch (const io::format_error&) {
  }
  FUZZ_CHECK(accepted == header_accepted);
  return 0;
}
