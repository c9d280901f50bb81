// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The command line of the GPU benchmarks: --params N, --repeats R, --json FILE.
#pragma once

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

namespace gpu_bench {

struct options {
  std::size_t params = 321'000'000;
  int repeats = 20;
  std::string json;
};

[[noreturn]] inline void usage(const char* program, const std::string& why) {
  std::fprintf(stderr, "%s: %s\nusage: %s [--params N] [--repeats R] [--json FILE]\n", program, why.c_str(), program);
  std::exit(2);
}

/// Parses the options (exit code 2 with a usage line on a bad one); `repeats`: the default.
inline options parse(const char* program, int argc, char** argv, int repeats) {
  options o;
  o.repeats = repeats;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(program, "missing value after " + a);
    const std::string v = argv[++i];
    try {
      if (a == "--params") o.params = std::stoull(v);
      else if (a == "--repeats") o.repeats = std::stoi(v);
      else if (a == "--json") o.json = v;
      else usage(program, "unknown option " + a);
    } catch (const std::logic_error&) {
      usage(program, "bad value '" + v + "' for " + a);
    }
  }
  if (o.params < 1024 || o.repeats < 1) usage(program, "--params must be >= 1024 and --repeats >= 1");
  return o;
}

/// The --json file opened for appending (none: a closed stream); throws if it cannot be.
inline std::ofstream open_json(const std::string& path) {
  std::ofstream json;
  if (path.empty()) return json;
  json.open(path, std::ios::app);
  if (!json) throw std::runtime_error("cannot open " + path);
  return json;
}

}  // namespace gpu_bench
