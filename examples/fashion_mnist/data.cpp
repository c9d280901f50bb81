// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Reads Fashion-MNIST's idx files (gzipped or not: gzread passes plain files through).

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "fashion_mnist.hpp"

namespace fmnist {
namespace {

constexpr std::uint32_t image_magic = 0x00000803;  // unsigned bytes, 3 dimensions
constexpr std::uint32_t label_magic = 0x00000801;  // unsigned bytes, 1 dimension
constexpr std::uint32_t side = 28;
/// Far above the 60000 of the real files; guards the allocation against a corrupt count.
constexpr std::uint32_t max_count = 1'000'000;

std::string hex32(std::uint32_t v) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", v);
  return s;
}

/// A gzFile that closes itself.
class gz_reader {
 public:
  explicit gz_reader(const std::string& path) : path_(path) {
    errno = 0;
    f_ = gzopen(path.c_str(), "rb");
    if (!f_)
      throw usage_error(path + ": cannot open (" + (errno ? std::strerror(errno) : "out of memory") + ")");
    gzbuffer(f_, 1u << 17);  // fewer, larger reads: decompression is most of the load time
  }
  gz_reader(const gz_reader&) = delete;
  gz_reader& operator=(const gz_reader&) = delete;
  ~gz_reader() { gzclose(f_); }

  /// Reads exactly `n` bytes or throws naming the file and `what`.
  void read(void* dst, std::size_t n, const std::string& what) {
    auto* out = static_cast<unsigned char*>(dst);
    std::size_t got = 0;
    while (got < n) {
      const unsigned ask = static_cast<unsigned>(std::min<std::size_t>(n - got, 1u << 30));
      const int r = gzread(f_, out + got, ask);
      if (r < 0) throw usage_error(path_ + ": corrupt gzip data (" + zlib_message() + ")");
      if (r == 0) break;
      got += static_cast<std::size_t>(r);
    }
    if (got < n) {
      std::string why = zlib_message();
      throw usage_error(path_ + ": truncated: expected " + std::to_string(n) + " bytes of " + what +
                        ", got " + std::to_string(got) + (why.empty() ? "" : " (" + why + ")"));
    }
  }

  std::uint32_t read_be32(const std::string& what) {
    unsigned char b[4];
    read(b, 4, what);
    return std::uint32_t(b[0]) << 24 | std::uint32_t(b[1]) << 16 | std::uint32_t(b[2]) << 8 | b[3];
  }

  /// True when nothing follows what has been read (a longer file is not the one we expect).
  bool at_end() {
    unsigned char b;
    return gzread(f_, &b, 1) == 0;
  }

 private:
  std::string zlib_message() {
    int code = Z_OK;
    const char* m = gzerror(f_, &code);
    if (code == Z_OK || !m) return {};
    std::string_view s(m);  // zlib prefixes the path, which our message already starts with
    if (s.starts_with(path_ + ": ")) s.remove_prefix(path_.size() + 2);
    return std::string(s);
  }

  std::string path_;
  gzFile f_ = nullptr;
};

/// The file `name`.gz in `dir`, or `name` uncompressed if only that exists.
std::string find_file(const std::string& dir, const std::string& name, bool default_dir) {
  namespace fs = std::filesystem;
  const fs::path gz = fs::path(dir) / (name + ".gz");
  const fs::path plain = fs::path(dir) / name;
  std::error_code ec;
  if (fs::exists(gz, ec)) return gz.string();
  if (fs::exists(plain, ec)) return plain.string();
  throw usage_error(gz.string() + ": no such file" +
                    (default_dir ? " (install the data set: apt-get install dataset-fashion-mnist)"
                                 : ""));
}

void expect_end(gz_reader& f, const std::string& path, std::uint32_t count, const char* what) {
  if (!f.at_end())
    throw usage_error(path + ": unexpected data after " + std::to_string(count) + " " + what);
}

std::uint32_t read_count(gz_reader& f, const std::string& path) {
  const std::uint32_t count = f.read_be32("header");
  if (count == 0 || count > max_count)
    throw usage_error(path + ": implausible sample count " + std::to_string(count) + " in the header");
  return count;
}

split read_split(const std::string& images_path, const std::string& labels_path) {
  split s;
  {
    gz_reader f(images_path);
    const std::uint32_t magic = f.read_be32("header");
    if (magic != image_magic)
      throw usage_error(images_path + ": not an idx image file (magic " + hex32(magic) + ", expected " +
                        hex32(image_magic) + ")");
    s.count = read_count(f, images_path);
    const std::uint32_t rows = f.read_be32("header"), cols = f.read_be32("header");
    if (rows != side || cols != side)
      throw usage_error(images_path + ": images are " + std::to_string(rows) + "x" +
                        std::to_string(cols) + ", expected 28x28");
    std::vector<std::uint8_t> raw(s.count * side * side);
    f.read(raw.data(), raw.size(), "pixels");
    expect_end(f, images_path, static_cast<std::uint32_t>(s.count), "images");
    s.images.resize(raw.size());
    std::transform(raw.begin(), raw.end(), s.images.begin(),
                   [](std::uint8_t v) { return static_cast<float>(v) / 255.0f; });
  }
  gz_reader f(labels_path);
  const std::uint32_t magic = f.read_be32("header");
  if (magic != label_magic)
    throw usage_error(labels_path + ": not an idx label file (magic " + hex32(magic) + ", expected " +
                      hex32(label_magic) + ")");
  const std::uint32_t count = read_count(f, labels_path);
  if (count != s.count)
    throw usage_error(labels_path + ": " + std::to_string(count) + " labels, but " + images_path +
                      " holds " + std::to_string(s.count) + " images");
  s.labels.resize(count);
  f.read(s.labels.data(), count, "labels");
  expect_end(f, labels_path, count, "labels");
  for (std::size_t i = 0; i < s.labels.size(); ++i)
    if (s.labels[i] > 9)
      throw usage_error(labels_path + ": label " + std::to_string(s.labels[i]) + " of sample " +
                        std::to_string(i) + " is not a class (0..9)");
  return s;
}

}  // namespace

dataset load_dataset(const config& cfg) {
  namespace fs = std::filesystem;
  const bool default_dir = cfg.data_dir == default_data_dir;
  std::error_code ec;
  if (!fs::is_directory(cfg.data_dir, ec))
    throw usage_error(cfg.data_dir + ": no such directory" +
                      (default_dir ? std::string(" (install the data set: apt-get install dataset-fashion-mnist)")
                                   : std::string(" (--data must name a directory holding "
                                                 "train-images-idx3-ubyte.gz and the other idx files)")));
  auto file = [&](const char* name) { return find_file(cfg.data_dir, name, default_dir); };

  dataset d;
  d.pixels = side * side;
  d.train = read_split(file("train-images-idx3-ubyte"), file("train-labels-idx1-ubyte"));
  d.test = read_split(file("t10k-images-idx3-ubyte"), file("t10k-labels-idx1-ubyte"));

  if (cfg.limit != 0 && cfg.limit < d.train.count) {
    d.train.count = cfg.limit;
    d.train.images.resize(cfg.limit * d.pixels);
    d.train.labels.resize(cfg.limit);
  }
  if (cfg.normalize) {
    // Statistics of the training samples in use only, so the test set stays unseen.
    double sum = 0.0, sum_sq = 0.0;
    for (float v : d.train.images) sum += v, sum_sq += double(v) * v;
    const double n = static_cast<double>(d.train.images.size());
    const double mean = sum / n;
    const double stdev = std::sqrt(std::max(sum_sq / n - mean * mean, 1e-12));
    const float shift = static_cast<float>(mean), scale = static_cast<float>(1.0 / stdev);
    for (auto* s : {&d.train, &d.test})
      for (float& v : s->images) v = (v - shift) * scale;
  }
  return d;
}

}  // namespace fmnist
