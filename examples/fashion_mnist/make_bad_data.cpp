// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Test helper: writes tiny Fashion-MNIST directories under DIR, one valid and one per way
// an idx file can be broken, for the example.fashion_mnist.data.* tests.
// (CMake scripts cannot write the NUL bytes every idx header holds.)

#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using bytes = std::vector<unsigned char>;

namespace {

void put_be32(bytes& b, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<unsigned char>(v >> s));
}

bytes images(std::uint32_t magic, std::uint32_t count, std::uint32_t rows, std::uint32_t cols,
             std::uint32_t stored) {
  bytes b;
  put_be32(b, magic);
  put_be32(b, count);
  put_be32(b, rows);
  put_be32(b, cols);
  for (std::uint32_t i = 0; i < stored * rows * cols; ++i) b.push_back(static_cast<unsigned char>(i * 7));
  return b;
}

bytes labels(std::uint32_t count, bytes values) {
  bytes b;
  put_be32(b, 0x00000801);
  put_be32(b, count);
  b.insert(b.end(), values.begin(), values.end());
  return b;
}

/// Writes `data` gzipped, or stored as is ("T": zlib's transparent mode) when `plain`.
void write(const fs::path& path, const bytes& data, bool plain = false) {
  gzFile f = gzopen(path.c_str(), plain ? "wbT" : "wb");
  if (!f || gzwrite(f, data.data(), static_cast<unsigned>(data.size())) != static_cast<int>(data.size()) ||
      gzclose(f) != Z_OK)
    throw std::runtime_error("cannot write " + path.string());
}

/// A fresh directory of four good files (two samples each; the test split uncompressed,
/// which gzread reads too); each case then overwrites or removes one of them.
fs::path make_case(const fs::path& root, const std::string& dir) {
  const fs::path d = root / dir;
  fs::remove_all(d);
  fs::create_directories(d);
  write(d / "train-images-idx3-ubyte.gz", images(0x803, 2, 28, 28, 2));
  write(d / "train-labels-idx1-ubyte.gz", labels(2, {0, 1}));
  write(d / "t10k-images-idx3-ubyte", images(0x803, 2, 28, 28, 2), true);
  write(d / "t10k-labels-idx1-ubyte", labels(2, {1, 0}), true);
  return d;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make-bad-data DIR\n");
    return 2;
  }
  const fs::path root = argv[1];
  const std::string train_images = "train-images-idx3-ubyte.gz";
  const std::string train_labels = "train-labels-idx1-ubyte.gz";

  make_case(root, "valid");
  write(make_case(root, "bad_magic") / train_images, images(0x801, 2, 28, 28, 2));
  write(make_case(root, "wrong_dims") / train_images, images(0x803, 2, 27, 28, 2));
  write(make_case(root, "truncated") / train_images, images(0x803, 3, 28, 28, 2));
  write(make_case(root, "trailing") / train_images, images(0x803, 1, 28, 28, 2));
  write(make_case(root, "count_mismatch") / train_labels, labels(3, {0, 1, 2}));
  write(make_case(root, "bad_label") / train_labels, labels(2, {0, 10}));
  fs::remove(make_case(root, "missing_file") / "t10k-labels-idx1-ubyte");
  {
    // A gzip stream cut in the middle, as from an interrupted download.
    const fs::path p = make_case(root, "truncated_gzip") / train_images;
    std::ifstream in(p, std::ios::binary);
    bytes gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    in.close();
    std::ofstream(p, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(gz.data()), static_cast<std::streamsize>(gz.size() / 2));
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "make-bad-data: %s\n", e.what());
  return 1;
}
