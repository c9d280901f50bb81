// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// libFuzzer target: the loader's logic across files (which rank files an index lists, what
// each holds, whether their slices cover every element), not the parsers. At start-up an
// AdamW optimizer sharded over three ranks (threads) takes two steps and saves; each input
// then builds a checkpoint directory from that save's three rank files: for each of the
// index's three places, which file's bytes go there (or none), whether the index's record
// of it (size, header checksum) is made to match, and a byte of the file to flip. Loading it
// into a one-rank optimizer must either throw io::checkpoint_error or give every param and
// state exactly as the untouched checkpoint does: a hole (two places holding the same
// slices, one file missing) must be refused, never filled with stale or zero bytes.
#include <distopt/checkpoint.hpp>
#include <distopt/distopt.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "fuzz_check.hpp"

namespace io = distopt::io;
namespace fs = std::filesystem;

namespace {

// One optimizer type (its instantiation is most of this target's compile time): saved on
// three ranks, loaded on one.
using opt_t = distopt::optimizer<distopt::adamw, distopt::sharded<distopt::fp32>, distopt::threads, distopt::cpu>;

// 1,536 elements over three ranks, 512 each: "a" spans ranks 0 and 1 in equal parts, so
// rank 0's file in two places gives "a" as many elements as it needs, rank 1's missing.
distopt::layout model() {
  distopt::layout l;
  l.add("a", {1024});
  l.add("b", {512});
  return l;
}

/// Every param, then every state slot, of a one-rank optimizer after loading `dir`; empty
/// when the load refused it (io::checkpoint_error, which run_ranks would wrap).
std::vector<float> load_all(const fs::path& dir) {
  std::vector<float> out;
  distopt::run_ranks(1, [&](distopt::threads& comm) {
    opt_t opt(model(), distopt::adamw::hyper_params{}, {}, distopt::cpu(1), std::move(comm));
    try {
      opt.load(dir);
    } catch (const io::checkpoint_error& e) {
      if (std::getenv("FUZZ_FILES_VERBOSE")) std::fprintf(stderr, "refused: %s\n", e.what());
      return;
    }
    for (const char* name : {"a", "b"}) {
      const auto p = opt.param(name);
      out.insert(out.end(), p.begin(), p.end());
      for (int slot = 0; slot < 2; ++slot) {
        const auto s = opt.state(name, slot);
        out.insert(out.end(), s.begin(), s.end());
      }
    }
  });
  return out;
}

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::vector<char>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

struct saved {
  fs::path root;  // the pristine save, then each input's directory
  io::detail::checkpoint_index index;
  std::vector<std::vector<char>> files;  // by the index's place (rank)
  std::vector<float> expected;
};

fs::path scratch;  // removed at exit
void remove_scratch() {
  std::error_code ec;
  fs::remove_all(scratch, ec);
}

const saved& pristine() {
  static const saved s = [] {
    saved out;
    char tmpl[] = "/tmp/distopt-fuzz-files-XXXXXX";
    FUZZ_CHECK(::mkdtemp(tmpl) != nullptr);
    out.root = scratch = tmpl;
    std::atexit(remove_scratch);
    const fs::path dir = out.root / "pristine";
    distopt::run_ranks(3, [&](distopt::threads& comm) {
      opt_t opt(model(), distopt::adamw::hyper_params{}, {}, distopt::cpu(1), std::move(comm));
      for (const char* name : {"a", "b"}) {
        auto p = opt.param(name);
        for (std::size_t i = 0; i < p.size(); ++i) p[i] = 0.25f * static_cast<float>(i % 97) - 3.0f;
      }
      for (int step = 0; step < 2; ++step) {
        for (const char* name : {"a", "b"}) {
          auto g = opt.grad(name);
          for (std::size_t i = 0; i < g.size(); ++i)
            g[i] = opt.communicator().rank() == 0 ? 0.01f * static_cast<float>((i * 7 + step) % 13) - 0.05f : 0.0f;
        }
        opt.step();
        opt.zero_grad();
      }
      opt.save(dir);
    });
    const auto text = read_bytes(dir / "index.json");
    out.index = io::detail::parse_index(std::string(text.begin(), text.end()), "index.json");
    FUZZ_CHECK(out.index.files.size() == 1 && out.index.files[0].size() == 3);
    for (const auto& f : out.index.files[0]) out.files.push_back(read_bytes(dir / f.name));
    out.expected = load_all(dir);
    FUZZ_CHECK(!out.expected.empty());
    return out;
  }();
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const saved& s = pristine();
  // Per place: [source file (0-2) or none (3), record made to match (bit 2)], a flipped
  // byte's position (two bytes; 0 = none) and its xor mask.
  if (size < 3 * 4) return 0;
  const fs::path dir = s.root / "input";
  fs::remove_all(dir);
  fs::create_directories(dir);
  io::detail::checkpoint_index index = s.index;
  for (std::size_t place = 0; place < 3; ++place) {
    const std::uint8_t* op = data + 4 * place;
    const std::size_t source = op[0] & 3u;
    auto& record = index.files[0][place];
    if (source == 3) continue;  // this place's file is missing
    std::vector<char> bytes = s.files[source];
    const std::size_t at = (static_cast<std::size_t>(op[1]) << 8 | op[2]) % bytes.size();
    if (at != 0) bytes[at] = static_cast<char>(bytes[at] ^ op[3]);
    if (op[0] & 4u) {  // the index's record of this place describes the bytes put there
      record.bytes = s.index.files[0][source].bytes;
      record.header_hash = s.index.files[0][source].header_hash;
    }
    write_bytes(dir / record.name, bytes);
  }
  {
    const std::string text = io::detail::index_text(index);
    std::ofstream(dir / "index.json", std::ios::binary | std::ios::trunc) << text;
  }
  const std::vector<float> got = load_all(dir);
  if (got.empty()) return 0;  // refused
  FUZZ_CHECK(got.size() == s.expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) FUZZ_CHECK(std::memcmp(&got[i], &s.expected[i], sizeof(float)) == 0);
  return 0;
}
