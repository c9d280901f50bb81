// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The run's record beside a checkpoint (DIR/distopt-gpt.run): what the optimizer's checkpoint
// does not hold and a resumed run must repeat, the data (--data, --batches) and its draws
// (--batch, --seed), the optimizer and the model's shape, as "flag value" lines, after the
// step it was written at ("step N": a record left from another save is refused).

#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpt.hpp"

namespace gpt {
namespace {

constexpr const char* record_name = "distopt-gpt.run";

std::string absolute(const std::string& path) {
  return path.empty() ? "(none)" : std::filesystem::weakly_canonical(std::filesystem::absolute(path)).string();
}

std::vector<std::pair<std::string, std::string>> record_of(const config& c) {
  const model_config& m = c.model;
  return {{"--data", absolute(c.data_dir)},      {"--batches", absolute(c.batches_path)},
          {"--optimizer", c.optimizer},           {"--batch", std::to_string(c.batch)},
          {"--seed", std::to_string(c.seed)},     {"--seq", std::to_string(m.seq)},
          {"--dim", std::to_string(m.dim)},       {"--layers", std::to_string(m.layers)},
          {"--heads", std::to_string(m.heads)},   {"--ffn", std::to_string(m.ffn)}};
}

}  // namespace

void write_run_record(const config& c, std::size_t step) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(c.checkpoint_dir) / record_name, partial = path.string() + ".partial";
  {
    std::ofstream out(partial);
    out << "step " << step << '\n';
    for (const auto& [flag, value] : record_of(c)) out << flag << ' ' << value << '\n';
    if (!out.flush()) throw std::runtime_error(partial.string() + ": cannot write");
  }
  fs::rename(partial, path);  // whole or not at all
}

std::size_t check_run_record(const config& c) {
  namespace fs = std::filesystem;
  if (!fs::exists(fs::path(c.resume_dir) / "index.json"))
    throw usage_error("--resume " + c.resume_dir + ": no checkpoint there (no index.json)");
  std::ifstream in(fs::path(c.resume_dir) / record_name);
  if (!in)
    throw usage_error("--resume " + c.resume_dir + ": no " + record_name + " beside the checkpoint (distopt-gpt " +
                      "records the saving run's data, --batch, --seed, --optimizer and model there; checkpoints of " +
                      "builds before it have none)");
  std::vector<std::pair<std::string, std::string>> saved;  // "flag value", the value to the line's end
  for (std::string line; std::getline(in, line);) {
    const auto space = line.find(' ');
    if (space != std::string::npos) saved.emplace_back(line.substr(0, space), line.substr(space + 1));
  }
  const auto saved_value = [&saved](const std::string& flag) {
    for (const auto& [f, v] : saved)
      if (f == flag) return v;
    return std::string("(none)");
  };
  for (const auto& [flag, value] : record_of(c)) {
    const std::string was = saved_value(flag);
    if (was != value)
      throw usage_error("--resume " + c.resume_dir + ": saved with " + flag + " " + was + ", this run has " + flag +
                        " " + value + " (a resumed run repeats the saving run's data, draws, optimizer and model)");
  }
  const std::string step = saved_value("step");
  char* end = nullptr;
  const unsigned long long n = std::strtoull(step.c_str(), &end, 10);
  if (step.empty() || *end != '\0')
    throw usage_error("--resume " + c.resume_dir + ": " + record_name + " has no step");
  return static_cast<std::size_t>(n);
}

}  // namespace gpt
