// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// compare-safetensors ACTUAL EXPECTED RTOL ATOL [SKIP,...]: every tensor of EXPECTED (but
// the comma-separated SKIP names) must be in ACTUAL with the same shape and
// |a - e| <= atol + rtol * |e| element-wise. Prints the worst element and exits 1 on a
// mismatch, and also when no element was compared (everything skipped, or no tensors):
// a comparison of nothing proves nothing.

#include <distopt/io/safetensors.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <set>
#include <sstream>
#include <string>

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: compare-safetensors ACTUAL EXPECTED RTOL ATOL [SKIP,...]\n");
    return 2;
  }
  std::set<std::string> skip;
  if (argc == 6) {
    std::istringstream names(argv[5]);
    for (std::string n; std::getline(names, n, ',');)
      if (!n.empty()) skip.insert(n);
  }
  try {
    const auto actual = distopt::io::safetensors_reader::open(argv[1]);
    const auto expected = distopt::io::safetensors_reader::open(argv[2]);
    const double rtol = std::stod(argv[3]), atol = std::stod(argv[4]);
    int bad = 0;
    std::size_t compared = 0;
    double worst = 0.0;  // largest |a - e| / (atol + rtol |e|)
    for (const auto& name : expected.names()) {
      if (skip.count(name)) {
        std::printf("tensor %s: not compared\n", name.c_str());
        continue;
      }
      if (!actual.contains(name)) {
        std::printf("missing tensor %s\n", name.c_str());
        ++bad;
        continue;
      }
      if (actual.info(name).shape != expected.info(name).shape) {
        std::printf("tensor %s: shapes differ\n", name.c_str());
        ++bad;
        continue;
      }
      const auto a = actual.read_f32(name), e = expected.read_f32(name);
      for (std::size_t i = 0; i < e.size(); ++i, ++compared) {
        const double err = std::fabs(double(a[i]) - double(e[i]));
        const double ratio = err / (atol + rtol * std::fabs(double(e[i])));
        if (!(ratio <= 1.0)) {
          if (bad < 10)
            std::printf("tensor %s[%zu]: actual %.9g expected %.9g (|diff| %.3g)\n", name.c_str(), i,
                        double(a[i]), double(e[i]), err);
          ++bad;
        }
        if (ratio > worst || std::isnan(ratio)) worst = ratio;
      }
    }
    std::printf("%zu elements compared, %d mismatches, worst error %.3f of the tolerance\n", compared,
                bad, worst);
    if (compared == 0) {
      std::printf("no elements compared: EXPECTED has no tensors, or all were skipped\n");
      return 1;
    }
    return bad ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "compare-safetensors: %s\n", e.what());
    return 2;
  }
}
