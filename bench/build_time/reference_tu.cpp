// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// A fixed translation unit with no distopt in it, compiled beside the README's first example
// by guard.sh: the ratio of the two compile times cancels the machine's speed. Standard
// library only, so that it changes only when the compiler does; do not edit it without
// recording a new figure (guard.sh --record).
#include <algorithm>
#include <functional>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

int main(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  std::map<std::string, std::vector<double>> by_name;
  std::unordered_map<std::string, int> counts;
  const std::regex number(R"(([a-z]+)=([0-9.]+))");
  for (const auto& a : args) {
    std::smatch m;
    if (std::regex_match(a, m, number)) {
      by_name[m[1]].push_back(std::stod(m[2]));
      ++counts[m[1]];
    }
  }
  std::vector<std::function<double(const std::vector<double>&)>> reducers = {
      [](const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); },
      [](const std::vector<double>& v) {
        double s = 0;
        for (double x : v) s += x;
        return s;
      }};
  std::ostringstream out;
  std::thread worker([&] {
    for (auto& [name, values] : by_name) {
      std::sort(values.begin(), values.end());
      for (const auto& r : reducers) out << name << ' ' << r(values) << ' ' << counts[name] << '\n';
    }
  });
  worker.join();
  return static_cast<int>(out.str().size() % 7);
}
