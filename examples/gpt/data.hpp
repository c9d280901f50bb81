// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The text distopt-gpt learns: Debian's fortune cookies (package fortunes), read as bytes
// (the tokenizer is the identity: a token is a byte, the vocabulary 256), split into a
// training and a held-out part, and the batches drawn from them.

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace gpt {

inline constexpr const char* default_corpus_dir = "/usr/share/games/fortunes";

/// The corpus: every fortune of the plain files under `dir` (not the .dat indices nor the
/// .u8 copies), files in name order. Fortunes are separated by lines of "%"; every tenth
/// (the 10th, 20th, ...) is held out for validation. Throws std::runtime_error naming the
/// directory when it is missing or holds no text (apt-get install fortunes).
struct corpus {
  std::vector<std::uint8_t> train, validation;
  std::size_t files = 0, fortunes = 0;
};
corpus load_corpus(const std::string& dir);

/// Batches of `count` windows of seq + 1 consecutive tokens (inputs, then the targets one
/// further), each starting at a uniformly drawn offset of `text`, from a generator seeded
/// with `seed`: the same seed gives the same batches on every rank and every run.
class batch_source {
 public:
  batch_source(const std::vector<std::uint8_t>& text, int seq, std::uint64_t seed);
  /// The next batch: count x (seq + 1) tokens, row by row.
  std::vector<std::int32_t> next(int count);
  /// Skips `batches` batches of `count` windows (a resumed run's past).
  void skip(std::size_t batches, int count);

 private:
  const std::vector<std::uint8_t>* text_;
  int seq_;
  std::mt19937_64 rng_;
  std::uniform_int_distribution<std::size_t> offset_;
};

}  // namespace gpt
