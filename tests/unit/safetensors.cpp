// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// safetensors reader/writer: round trips, exact conversions, byte-exact output and
// rejection of every malformed layout the reader validates.
#include <distopt/io/safetensors.hpp>

#include <boost/test/unit_test.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

namespace fs = std::filesystem;
namespace io = distopt::io;

namespace {

/// A fresh directory under the system temp dir, removed with everything in it.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::random_device entropy;
    path = fs::temp_directory_path() /
           ("distopt-safetensors-" + std::to_string(::getpid()) + "-" + std::to_string(entropy()));
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  fs::path operator/(const std::string& name) const { return path / name; }
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// 8-byte little-endian length, built byte by byte so it does not depend on the host.
std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xffu);
  return s;
}

/// A file with the given header text (used verbatim) and `data_size` zero bytes of data.
std::string file_with(const std::string& header, std::size_t data_size) {
  return le64(header.size()) + header + std::string(data_size, '\0');
}

template <class T>
std::span<const std::byte> byte_view(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

/// Writes `bytes` to dir/name, opens it and checks for a format_error whose what()
/// names the file and contains `phrase`.
void expect_refused(const temp_dir& dir, const std::string& name, const std::string& bytes,
                    const std::string& phrase) {
  const fs::path p = dir / name;
  spit(p, bytes);
  const auto names_problem = [&](const io::format_error& e) {
    const std::string what = e.what();
    const bool ok = what.find(p.string()) != std::string::npos &&
                    what.find(phrase) != std::string::npos;
    if (!ok) BOOST_TEST_MESSAGE("unexpected message: " << what << " (wanted '" << phrase << "')");
    return ok;
  };
  BOOST_TEST_CONTEXT(name) {
    BOOST_CHECK_EXCEPTION((void)io::safetensors_reader::open(p), io::format_error, names_problem);
  }
}

/// Bytes as integers, so Boost.Test can print a mismatch.
std::vector<int> as_ints(std::span<const std::byte> s) {
  std::vector<int> out;
  for (auto b : s) out.push_back(std::to_integer<int>(b));
  return out;
}

/// Same bits; distinguishes -0 from +0 and compares NaNs by payload.
bool same_bits(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

}  // namespace

BOOST_AUTO_TEST_SUITE(safetensors)

BOOST_AUTO_TEST_CASE(round_trip_several_tensors_and_metadata) {
  temp_dir dir;
  const std::vector<float> matrix{1.f, -2.f, 3.5f, 0.f, -0.f, 1e-30f};
  const std::vector<float> cube{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<float> scalar{42.25f};
  const std::vector<std::uint16_t> bf16_bits{0x3f80, 0xc000, 0x7f80, 0x0001};
  const std::vector<std::int64_t> step{7, -9};

  io::safetensors_writer w;
  w.set_metadata("format", "pt");
  w.set_metadata("step", "overwritten");
  w.set_metadata("step", "17");
  w.add_f32("param.w", {2, 3}, matrix);
  w.add_f32("param.cube", {2, 3, 2}, cube);
  w.add_f32("lr", {}, scalar);
  w.add("grad.bf16", "BF16", {4}, byte_view(bf16_bits));
  w.add("counts", "I64", {2}, byte_view(step));
  w.add("empty", "U8", {0}, {});
  const fs::path p = dir / "round.safetensors";
  w.write(p);

  const auto r = io::safetensors_reader::open(p);
  BOOST_TEST(r.path() == p);
  const std::map<std::string, std::string> meta{{"format", "pt"}, {"step", "17"}};
  BOOST_TEST((r.metadata() == meta));
  const std::vector<std::string> names{"counts", "empty", "grad.bf16", "lr", "param.cube", "param.w"};
  BOOST_TEST(r.names() == names, boost::test_tools::per_element());
  BOOST_TEST(r.contains("lr"));
  BOOST_TEST(!r.contains("param"));
  BOOST_TEST(!r.contains("__metadata__"));

  BOOST_TEST(r.info("param.w").dtype == "F32");
  BOOST_TEST(r.info("param.w").shape == (std::vector<std::int64_t>{2, 3}), boost::test_tools::per_element());
  BOOST_TEST(r.info("param.w").numel() == 6);
  BOOST_TEST(r.read_f32("param.w") == matrix, boost::test_tools::per_element());
  BOOST_TEST(same_bits(r.read_f32("param.w")[4], -0.f));

  BOOST_TEST(r.info("param.cube").shape.size() == 3u);
  BOOST_TEST(r.read_f32("param.cube") == cube, boost::test_tools::per_element());

  BOOST_TEST(r.info("lr").shape.empty());
  BOOST_TEST(r.info("lr").numel() == 1);
  BOOST_TEST(r.read_f32("lr") == scalar, boost::test_tools::per_element());

  BOOST_TEST(r.info("grad.bf16").dtype == "BF16");
  BOOST_TEST(as_ints(r.bytes("grad.bf16")) == as_ints(byte_view(bf16_bits)),
             boost::test_tools::per_element());
  BOOST_TEST(as_ints(r.bytes("counts")) == as_ints(byte_view(step)),
             boost::test_tools::per_element());

  BOOST_TEST(r.info("empty").numel() == 0);
  BOOST_TEST(r.bytes("empty").empty());
  BOOST_TEST(r.info("empty").begin == r.info("empty").end);

  // Tensors are laid out by name, back to back.
  BOOST_TEST(r.info("counts").begin == 0u);
  BOOST_TEST(r.info("empty").begin == 16u);
  BOOST_TEST(r.info("grad.bf16").begin == 16u);
  BOOST_TEST(r.info("lr").begin == 24u);
  BOOST_TEST(r.info("param.cube").begin == 28u);
  BOOST_TEST(r.info("param.w").begin == 76u);
  BOOST_TEST(r.info("param.w").end == 100u);

  // Overwriting an existing file replaces it and leaves no temporary behind.
  io::safetensors_writer w2;
  w2.add_f32("only", {1}, scalar);
  w2.write(p);
  BOOST_TEST(io::safetensors_reader::open(p).names() == std::vector<std::string>{"only"},
             boost::test_tools::per_element());
  BOOST_TEST(io::safetensors_reader::open(p).metadata().empty());
  BOOST_TEST(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()) == 1);
}

BOOST_AUTO_TEST_CASE(empty_file_without_tensors) {
  temp_dir dir;
  const fs::path p = dir / "empty.safetensors";
  io::safetensors_writer{}.write(p);
  BOOST_TEST(slurp(p) == le64(8) + "{}      ");
  const auto r = io::safetensors_reader::open(p);
  BOOST_TEST(r.names().empty());
  BOOST_TEST(r.metadata().empty());
}

// Expected values come from the IEEE definitions evaluated with ldexp, not from bit tricks.
BOOST_AUTO_TEST_CASE(read_f32_converts_bf16_and_f16_exactly) {
  temp_dir dir;
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);

  io::safetensors_writer w;
  w.add("all.bf16", "BF16", {65536}, byte_view(all));
  w.add("all.f16", "F16", {256, 256}, byte_view(all));
  const fs::path p = dir / "halves.safetensors";
  w.write(p);
  const auto r = io::safetensors_reader::open(p);
  const auto bf = r.read_f32("all.bf16");
  const auto hf = r.read_f32("all.f16");
  BOOST_REQUIRE(bf.size() == 65536u);
  BOOST_REQUIRE(hf.size() == 65536u);

  int bf_bad = 0;
  int hf_bad = 0;
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const double sign = (bits & 0x8000u) ? -1.0 : 1.0;
    {  // bfloat16: 8 exponent bits (bias 127), 7 mantissa bits
      const int e = static_cast<int>((bits >> 7) & 0xffu);
      const int m = static_cast<int>(bits & 0x7fu);
      const float got = bf[bits];
      if (e == 0xff) {
        bf_bad += m == 0 ? !(std::isinf(got) && std::signbit(got) == (sign < 0)) : !std::isnan(got);
      } else {
        const double v = e == 0 ? std::ldexp(m, -133) : std::ldexp(128 + m, e - 134);
        bf_bad += !same_bits(got, static_cast<float>(sign * v));
      }
    }
    {  // binary16: 5 exponent bits (bias 15), 10 mantissa bits
      const int e = static_cast<int>((bits >> 10) & 0x1fu);
      const int m = static_cast<int>(bits & 0x3ffu);
      const float got = hf[bits];
      if (e == 0x1f) {
        hf_bad += m == 0 ? !(std::isinf(got) && std::signbit(got) == (sign < 0)) : !std::isnan(got);
      } else {
        const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
        hf_bad += !same_bits(got, static_cast<float>(sign * v));
      }
    }
  }
  BOOST_TEST(bf_bad == 0);
  BOOST_TEST(hf_bad == 0);

  // A few well-known patterns spelled out.
  BOOST_TEST(bf[0x3f80] == 1.0f);
  BOOST_TEST(bf[0xc049] == -3.140625f);
  BOOST_TEST(same_bits(bf[0x8000], -0.0f));
  BOOST_TEST(bf[0x0001] == std::ldexp(1.0f, -133));
  BOOST_TEST(hf[0x3c00] == 1.0f);
  BOOST_TEST(hf[0x3555] == 0.333251953125f);
  BOOST_TEST(hf[0x7bff] == 65504.0f);
  BOOST_TEST(hf[0x0001] == std::ldexp(1.0f, -24));
  BOOST_TEST(hf[0x03ff] == 1023.0f * std::ldexp(1.0f, -24));
  BOOST_TEST(hf[0x0400] == std::ldexp(1.0f, -14));
  BOOST_TEST(hf[0xfc00] == -std::numeric_limits<float>::infinity());
  // NaN payloads survive the widening.
  BOOST_TEST(std::bit_cast<std::uint32_t>(hf[0x7e01]) == 0x7fc02000u);
  BOOST_TEST(std::bit_cast<std::uint32_t>(bf[0x7fc1]) == 0x7fc10000u);
}

BOOST_AUTO_TEST_CASE(read_f32_rounds_f64_and_refuses_integers) {
  temp_dir dir;
  const std::vector<double> d{0.1, -1.0 / 3.0, 1e300, 1.0 + std::ldexp(1.0, -30)};
  const std::vector<std::int32_t> ints{1, 2};
  io::safetensors_writer w;
  w.add("d", "F64", {4}, byte_view(d));
  w.add("i", "I32", {2}, byte_view(ints));
  const fs::path p = dir / "f64.safetensors";
  w.write(p);
  const auto r = io::safetensors_reader::open(p);
  const auto f = r.read_f32("d");
  BOOST_TEST(f[0] == 0.1f);
  BOOST_TEST(f[1] == static_cast<float>(-1.0 / 3.0));
  BOOST_TEST(f[2] == std::numeric_limits<float>::infinity());
  BOOST_TEST(f[3] == 1.0f);
  BOOST_CHECK_EXCEPTION((void)r.read_f32("i"), io::format_error, [&](const io::format_error& e) {
    return std::string(e.what()).find(p.string() + ": tensor 'i': read_f32 cannot convert dtype I32") == 0;
  });
}

// The file must match the reference layout byte for byte.
BOOST_AUTO_TEST_CASE(byte_exact_small_file) {
  temp_dir dir;
  io::safetensors_writer w;
  const std::vector<std::uint8_t> u8{1, 2, 3};
  w.add("b", "U8", {3}, byte_view(u8));
  w.add_f32("a", {2}, std::vector<float>{1.0f, -2.0f});
  w.set_metadata("format", "pt");
  const fs::path p = dir / "exact.safetensors";
  w.write(p);

  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})";
  BOOST_REQUIRE(header.size() == 138u);
  std::string expected("\x90\0\0\0\0\0\0\0", 8);  // 138 + 6 spaces = 144 = 0x90
  expected += header + "      ";
  expected += std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8);  // 1.0f, -2.0f
  expected += std::string("\x01\x02\x03", 3);
  BOOST_TEST(slurp(p) == expected);
}

BOOST_AUTO_TEST_CASE(truncated_copies_are_refused) {
  temp_dir dir;
  io::safetensors_writer w;
  w.add_f32("x", {3}, std::vector<float>{1, 2, 3});
  w.add_f32("y", {2, 2}, std::vector<float>{4, 5, 6, 7});
  const fs::path p = dir / "whole.safetensors";
  w.write(p);
  const std::string whole = slurp(p);
  std::uint64_t n = 0;
  std::memcpy(&n, whole.data(), 8);
  const std::size_t header_end = 8 + static_cast<std::size_t>(n);
  BOOST_REQUIRE(whole.size() == header_end + 28);

  struct cut {
    std::size_t at;
    const char* phrase;
  };
  const cut cuts[] = {
      {0, "smaller than the 8-byte header length field"},
      {1, "smaller than the 8-byte header length field"},
      {7, "smaller than the 8-byte header length field"},
      {8, "exceeds file size 8"},
      {9, "exceeds file size 9"},
      {header_end - 1, "exceeds file size"},
      {header_end, "exceed the data section (0 bytes)"},
      {header_end + 1, "exceed the data section (1 bytes)"},
      {header_end + 12, "tensor 'y': data offsets [12, 28) exceed the data section (12 bytes)"},
      {whole.size() - 1, "exceed the data section (27 bytes)"},
  };
  for (const auto& c : cuts) {
    expect_refused(dir, "cut" + std::to_string(c.at) + ".safetensors", whole.substr(0, c.at), c.phrase);
  }
  // Trailing garbage is refused too.
  expect_refused(dir, "long.safetensors", whole + "!", "bytes [28, 29) after the last tensor belong to no tensor");
}

BOOST_AUTO_TEST_CASE(malformed_framing_and_json) {
  temp_dir dir;
  expect_refused(dir, "short.safetensors", "abcde", "file size 5 is smaller than the 8-byte header length field");
  expect_refused(dir, "length.safetensors", le64(1234567) + std::string(92, ' '),
                 "header length 1234567 exceeds file size 100");
  expect_refused(dir, "huge.safetensors", le64(~std::uint64_t{0}) + "{}",
                 "header length 18446744073709551615 exceeds file size 10");
  expect_refused(dir, "zero.safetensors", le64(0), "header does not start with '{'");
  expect_refused(dir, "array.safetensors", file_with("[1, 2, 3]", 0), "it must be a JSON object");
  expect_refused(dir, "space.safetensors", file_with(" {}", 0), "header does not start with '{'");
  expect_refused(dir, "json.safetensors", file_with("{not json}", 0), "header is not valid JSON");
  expect_refused(dir, "unclosed.safetensors", file_with(R"({"a":)", 0), "header is not valid JSON");
  expect_refused(dir, "utf8.safetensors", file_with("{\"\xff\":1}", 0), "header is not valid JSON");
  expect_refused(dir, "meta.safetensors", file_with(R"({"__metadata__":[1]})", 0),
                 "'__metadata__' is not a JSON object");
  expect_refused(dir, "metaval.safetensors", file_with(R"({"__metadata__":{"k":1}})", 0),
                 "'__metadata__' value of 'k' is not a string");
}

BOOST_AUTO_TEST_CASE(duplicate_keys) {
  temp_dir dir;
  const std::string entry = R"({"dtype":"U8","shape":[1],"data_offsets":[0,1]})";
  expect_refused(dir, "top.safetensors", file_with(R"({"w":)" + entry + R"(,"w":)" + entry + "}", 1),
                 "duplicate key 'w' in header");
  expect_refused(dir, "inner.safetensors",
                 file_with(R"({"w":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1),
                 "duplicate key 'dtype' in header");
  expect_refused(dir, "meta.safetensors",
                 file_with(R"({"__metadata__":{"k":"a","k":"b"},"w":)" + entry + "}", 1),
                 "duplicate key 'k' in header");
  // The same key in different objects is fine.
  spit(dir / "ok.safetensors",
       file_with(R"({"__metadata__":{"dtype":"x"},"dtype":)" + entry + "}", 1));
  BOOST_TEST(io::safetensors_reader::open(dir / "ok.safetensors").contains("dtype"));
}

BOOST_AUTO_TEST_CASE(malformed_entries) {
  temp_dir dir;
  const auto one = [](const std::string& body) { return file_with(R"({"t":)" + body + "}", 4); };
  expect_refused(dir, "notobj.safetensors", one("[1]"), "tensor 't': entry is not a JSON object");
  expect_refused(dir, "nodtype.safetensors", one(R"({"shape":[4],"data_offsets":[0,4]})"),
                 "tensor 't': missing 'dtype'");
  expect_refused(dir, "noshape.safetensors", one(R"({"dtype":"U8","data_offsets":[0,4]})"),
                 "tensor 't': missing 'shape'");
  expect_refused(dir, "nooffsets.safetensors", one(R"({"dtype":"U8","shape":[4]})"),
                 "tensor 't': missing 'data_offsets'");
  expect_refused(dir, "extra.safetensors", one(R"({"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":1})"),
                 "tensor 't': unexpected key 'x'");
  expect_refused(dir, "dtypenum.safetensors", one(R"({"dtype":4,"shape":[4],"data_offsets":[0,4]})"),
                 "tensor 't': 'dtype' is not a string");
  expect_refused(dir, "dtypeunk.safetensors", one(R"({"dtype":"F128","shape":[4],"data_offsets":[0,4]})"),
                 "tensor 't': unknown dtype 'F128'");
  expect_refused(dir, "shapeobj.safetensors", one(R"({"dtype":"U8","shape":4,"data_offsets":[0,4]})"),
                 "tensor 't': 'shape' is not an array");
  expect_refused(dir, "shapefloat.safetensors", one(R"({"dtype":"U8","shape":[4.0],"data_offsets":[0,4]})"),
                 "tensor 't': 'shape' element 4.0 is not an integer");
  expect_refused(dir, "shapestr.safetensors", one(R"({"dtype":"U8","shape":["4"],"data_offsets":[0,4]})"),
                 "tensor 't': 'shape' element \"4\" is not an integer");
  expect_refused(dir, "negdim.safetensors", one(R"({"dtype":"U8","shape":[-4],"data_offsets":[0,4]})"),
                 "tensor 't': negative dimension -4 in shape");
  expect_refused(dir, "bigdim.safetensors",
                 one(R"({"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,4]})"),
                 "tensor 't': dimension 9223372036854775808 is too large");
  expect_refused(dir, "numel.safetensors",
                 one(R"({"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,4]})"),
                 "tensor 't': size of dtype U8 and shape [4294967296, 4294967296] overflows 64 bits");
  expect_refused(dir, "bytes.safetensors",
                 one(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,4]})"),
                 "overflows 64 bits");
  expect_refused(dir, "offobj.safetensors", one(R"({"dtype":"U8","shape":[4],"data_offsets":{"a":0}})"),
                 "tensor 't': 'data_offsets' is not an array of two integers");
  expect_refused(dir, "off3.safetensors", one(R"({"dtype":"U8","shape":[4],"data_offsets":[0,4,8]})"),
                 "tensor 't': 'data_offsets' is not an array of two integers");
  expect_refused(dir, "offneg.safetensors", one(R"({"dtype":"U8","shape":[4],"data_offsets":[-1,3]})"),
                 "tensor 't': negative data offset -1");
  expect_refused(dir, "offfloat.safetensors", one(R"({"dtype":"U8","shape":[4],"data_offsets":[0,4.5]})"),
                 "tensor 't': 'data_offsets' element 4.5 is not an integer");
}

BOOST_AUTO_TEST_CASE(malformed_offsets_and_coverage) {
  temp_dir dir;
  // The exact message, as the replay tool will show it.
  {
    const fs::path p = dir / "x.safetensors";
    spit(p, file_with(R"({"param.w":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})", 12));
    BOOST_CHECK_EXCEPTION((void)io::safetensors_reader::open(p), io::format_error, [&](const io::format_error& e) {
      return std::string(e.what()) == p.string() +
                                          ": tensor 'param.w': data offsets [0, 12) do not match dtype F32 "
                                          "and shape [4] (16 bytes)";
    });
  }
  expect_refused(dir, "reversed.safetensors",
                 file_with(R"({"t":{"dtype":"U8","shape":[4],"data_offsets":[4,0]}})", 4),
                 "tensor 't': data offsets [4, 0) are reversed");
  expect_refused(dir, "outside.safetensors",
                 file_with(R"({"t":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 4),
                 "tensor 't': data offsets [2, 6) exceed the data section (4 bytes)");
  expect_refused(dir, "overlap.safetensors",
                 file_with(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           12),
                 "tensors 'a' [0, 8) and 'b' [4, 12) overlap");
  expect_refused(dir, "same.safetensors",
                 file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
                           4),
                 "tensors 'a' [0, 4) and 'b' [0, 4) overlap");
  expect_refused(dir, "hole.safetensors",
                 file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                           12),
                 "hole in the data section: bytes [4, 8) belong to no tensor");
  expect_refused(dir, "leading.safetensors",
                 file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                 "hole in the data section: bytes [0, 4) belong to no tensor");
  expect_refused(dir, "trailing.safetensors",
                 file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8),
                 "hole in the data section: bytes [4, 8) after the last tensor");
  expect_refused(dir, "nodata.safetensors", file_with("{}", 3),
                 "hole in the data section: bytes [0, 3) after the last tensor");

  // Out-of-order entries, zero-sized tensors and trailing header spaces are all valid.
  const fs::path ok = dir / "ok.safetensors";
  spit(ok, file_with(R"({"z":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                     R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[2,2]},)"
                     R"("a":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}   )",
                     3));
  const auto r = io::safetensors_reader::open(ok);
  BOOST_TEST(r.names() == (std::vector<std::string>{"a", "e", "z"}), boost::test_tools::per_element());
  BOOST_TEST(r.read_f32("e").empty());
}

BOOST_AUTO_TEST_CASE(missing_tensors_and_unreadable_files) {
  temp_dir dir;
  io::safetensors_writer w;
  w.add_f32("w", {1}, std::vector<float>{1});
  const fs::path p = dir / "m.safetensors";
  w.write(p);
  const auto r = io::safetensors_reader::open(p);
  const auto missing = [&](const io::format_error& e) {
    return std::string(e.what()) == p.string() + ": missing tensor 'x'";
  };
  BOOST_CHECK_EXCEPTION((void)r.info("x"), io::format_error, missing);
  BOOST_CHECK_EXCEPTION((void)r.bytes("x"), io::format_error, missing);
  BOOST_CHECK_EXCEPTION((void)r.read_f32("x"), io::format_error, missing);

  // A file that cannot be opened is an I/O error, not a format error.
  const fs::path absent = dir / "absent.safetensors";
  try {
    (void)io::safetensors_reader::open(absent);
    BOOST_ERROR("opening a missing file did not throw");
  } catch (const io::format_error&) {
    BOOST_ERROR("a missing file was reported as a format error");
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    BOOST_TEST(what.find(absent.string()) != std::string::npos);
    BOOST_TEST(what.find("No such file or directory") != std::string::npos);
  }
}

BOOST_AUTO_TEST_CASE(writer_rejects_bad_tensors) {
  io::safetensors_writer w;
  const std::vector<float> four{1, 2, 3, 4};
  w.add_f32("a", {4}, four);
  BOOST_CHECK_THROW(w.add_f32("a", {4}, four), std::invalid_argument);
  BOOST_CHECK_THROW(w.add_f32("b", {3}, four), std::invalid_argument);
  BOOST_CHECK_THROW(w.add_f32("b", {2, 3}, four), std::invalid_argument);
  BOOST_CHECK_THROW(w.add("b", "F32", {-4}, std::as_bytes(std::span<const float>(four))), std::invalid_argument);
  BOOST_CHECK_THROW(w.add("b", "F128", {1}, std::as_bytes(std::span<const float>(four))), std::invalid_argument);
  BOOST_CHECK_THROW(w.add("b", "BF16", {4}, std::as_bytes(std::span<const float>(four))), std::invalid_argument);
  BOOST_CHECK_THROW(w.add_f32("__metadata__", {4}, four), std::invalid_argument);
  BOOST_CHECK_THROW(w.add_f32("bad\xff", {4}, four), std::invalid_argument);
  BOOST_CHECK_THROW(w.set_metadata("k", "bad\xc3"), std::invalid_argument);
  BOOST_CHECK_NO_THROW(w.add("b", "BF16", {8}, std::as_bytes(std::span<const float>(four))));
}

BOOST_AUTO_TEST_CASE(write_failures_name_the_path_and_leave_no_temporary) {
  temp_dir dir;
  io::safetensors_writer w;
  w.add_f32("w", {2}, std::vector<float>{1, 2});

  const fs::path nowhere = dir / "no" / "such" / "dir" / "t.safetensors";
  BOOST_CHECK_EXCEPTION(w.write(nowhere), std::runtime_error, [&](const std::runtime_error& e) {
    const std::string what = e.what();
    return what.find(nowhere.string()) != std::string::npos &&
           what.find("No such file or directory") != std::string::npos;
  });

  // Renaming a file over a directory fails after the data was written: the temporary goes.
  const fs::path occupied = dir / "occupied";
  fs::create_directory(occupied);
  BOOST_CHECK_EXCEPTION(w.write(occupied), std::runtime_error, [&](const std::runtime_error& e) {
    const std::string what = e.what();
    return what.find(occupied.string() + ": cannot rename temporary file") == 0 &&
           what.find("Is a directory") != std::string::npos;
  });
  std::vector<fs::path> left;
  for (const auto& entry : fs::directory_iterator(dir.path)) left.push_back(entry.path());
  BOOST_TEST(left.size() == 1u);
  BOOST_TEST(fs::is_directory(occupied));
}

BOOST_AUTO_TEST_SUITE_END()
