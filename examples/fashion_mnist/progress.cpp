// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "progress.hpp"

#include <cstdio>
#include <string>

#include <unistd.h>

namespace fmnist {

progress_bar::progress_bar(int epoch, int epochs, std::size_t total)
    : epoch_(epoch),
      epochs_(epochs),
      total_(total),
      start_(clock::now()),
      last_draw_(start_),
      terminal_(isatty(fileno(stderr)) == 1) {}

void progress_bar::update(std::size_t done, double mean_loss) {
  const auto now = clock::now();
  if (terminal_ ? drawn_ && now - last_draw_ < std::chrono::milliseconds(100)
                : now - last_draw_ < std::chrono::seconds(10))
    return;
  last_draw_ = now;
  draw(done, mean_loss);
}

void progress_bar::finish(double mean_loss) {
  draw(total_, mean_loss);
  if (terminal_) std::fputc('\n', stderr);
  std::fflush(stderr);
}

void progress_bar::draw(std::size_t done, double mean_loss) {
  constexpr int width = 30;
  const int filled = total_ ? static_cast<int>(width * done / total_) : width;
  const double seconds = std::chrono::duration<double>(clock::now() - start_).count();
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0.0;
  const std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
  if (terminal_)
    std::fprintf(stderr, "\repoch %d/%d [%s] %zu/%zu  %7.0f samples/s  loss %.4f ", epoch_, epochs_,
                 bar.c_str(), done, total_, rate, mean_loss);
  else
    std::fprintf(stderr, "epoch %d/%d %zu/%zu  %.0f samples/s  loss %.4f\n", epoch_, epochs_, done, total_, rate,
                 mean_loss);
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace fmnist
