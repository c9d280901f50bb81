// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The run's record beside a checkpoint (DIR/distopt-gpt.run): what the optimizer's checkpoint
// does not hold and a resumed run must repeat, the data's draws (--batch, --seed), the
// optimizer and the model's shape, as "flag value" lines.

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "gpt.hpp"

namespace gpt {
namespace {

constexpr const char* record_name = "distopt-gpt.run";

std::vector<std::pair<std::string, std::string>> record_of(const config& c) {
  const model_config& m = c.model;
  return {{"--optimizer", c.optimizer},           {"--batch", std::to_string(c.batch)},
          {"--seed", std::to_string(c.seed)},     {"--seq", std::to_string(m.seq)},
          {"--dim", std::to_string(m.dim)},       {"--layers", std::to_string(m.layers)},
          {"--heads", std::to_string(m.heads)},   {"--ffn", std::to_string(m.ffn)}};
}

}  // namespace

void write_run_record(const config& c) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(c.checkpoint_dir) / record_name, partial = path.string() + ".partial";
  {
    std::ofstream out(partial);
    for (const auto& [flag, value] : record_of(c)) out << flag << ' ' << value << '\n';
    if (!out.flush()) throw std::runtime_error(partial.string() + ": cannot write");
  }
  fs::rename(partial, path);  // whole or not at all
}

void check_run_record(const config& c) {
  const std::string path = (std::filesystem::path(c.resume_dir) / record_name).string();
  std::ifstream in(path);
  if (!in)
    throw usage_error("--resume " + c.resume_dir + ": no " + record_name + " beside the checkpoint (distopt-gpt " +
                      "records the saving run's --batch, --seed, --optimizer and model there)");
  std::vector<std::pair<std::string, std::string>> saved;
  for (std::string flag, value; in >> flag >> value;) saved.emplace_back(flag, value);
  for (const auto& [flag, value] : record_of(c)) {
    std::string was = "(none)";
    for (const auto& [f, v] : saved)
      if (f == flag) was = v;
    if (was != value)
      throw usage_error("--resume " + c.resume_dir + ": saved with " + flag + " " + was + ", this run has " + flag +
                        " " + value + " (a resumed run repeats the saving run's data draws, optimizer and model)");
  }
}

}  // namespace gpt
