// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// A one-line progress bar on stderr, redrawn in place with '\r' on a terminal; elsewhere (a
// log file, a pipe, CI) a plain line every ten seconds and one at the end of the epoch.

#include <chrono>
#include <cstddef>

namespace fmnist {

/// Progress through one epoch: samples done, samples/s and the running mean loss.
/// Redraws at most ten times a second, so a fast loop is not slowed by terminal output.
/// When stderr is not a terminal, each report is a line of its own: at most one every ten
/// seconds, and the last.
class progress_bar {
 public:
  progress_bar(int epoch, int epochs, std::size_t total);
  /// Records that `done` samples are through, with `mean_loss` over them so far.
  void update(std::size_t done, double mean_loss);
  /// Draws the final state and ends the line.
  void finish(double mean_loss);

 private:
  using clock = std::chrono::steady_clock;
  void draw(std::size_t done, double mean_loss);

  int epoch_, epochs_;
  std::size_t total_;
  clock::time_point start_, last_draw_;
  bool drawn_ = false;
  bool terminal_;  // stderr is a terminal: redraw in place
};

}  // namespace fmnist
