// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "data.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>

namespace gpt {

corpus load_corpus(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw std::runtime_error(dir + ": no such directory (the corpus is Debian's fortune cookies: apt-get install "
                             "fortunes, or tools/install-deps; --data DIR names another)");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && !e.path().has_extension()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  corpus c;
  auto add = [&c](std::string& fortune) {
    while (!fortune.empty() && fortune.back() == '\n') fortune.pop_back();
    if (fortune.empty()) return;
    auto& into = ++c.fortunes % 10 == 0 ? c.validation : c.train;
    into.insert(into.end(), fortune.begin(), fortune.end());
    into.insert(into.end(), {'\n', '\n'});
    fortune.clear();
  };
  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw std::runtime_error(f.string() + ": cannot read");
    ++c.files;
    std::string line, fortune;
    while (std::getline(in, line)) {
      if (line == "%") {
        add(fortune);
        continue;
      }
      fortune += line;
      fortune += '\n';
    }
    add(fortune);
  }
  if (c.train.empty() || c.validation.empty())
    throw std::runtime_error(dir + ": no fortunes found (plain files of text separated by lines of %)");
  return c;
}

batch_source::batch_source(const std::vector<std::uint8_t>& text, int seq, std::uint64_t seed)
    : text_(&text), seq_(seq), rng_(seed) {
  if (text.size() <= static_cast<std::size_t>(seq) + 1)
    throw std::invalid_argument("--seq " + std::to_string(seq) + " is longer than the text (" +
                                std::to_string(text.size()) + " bytes)");
  offset_ = std::uniform_int_distribution<std::size_t>(0, text.size() - static_cast<std::size_t>(seq) - 1);
}

std::vector<std::int32_t> batch_source::next(int count) {
  std::vector<std::int32_t> tokens;
  tokens.reserve(static_cast<std::size_t>(count) * (seq_ + 1));
  for (int b = 0; b < count; ++b) {
    const std::size_t at = offset_(rng_);
    for (int t = 0; t <= seq_; ++t) tokens.push_back((*text_)[at + static_cast<std::size_t>(t)]);
  }
  return tokens;
}

void batch_source::skip(std::size_t batches, int count) {
  for (std::size_t i = 0; i < batches * static_cast<std::size_t>(count); ++i) (void)offset_(rng_);
}

}  // namespace gpt
