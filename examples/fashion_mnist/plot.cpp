// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Loss and accuracy curves drawn by gnuplot, fed a generated script (data inline) on stdin,
// and the early check that the output files can be written.

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

#include "fashion_mnist.hpp"

namespace fmnist {
namespace {

/// A gnuplot single-quoted string: only the quote itself needs escaping (doubled).
std::string quoted(std::string_view s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (::access(((dir.empty() ? "." : dir) + "/" + program).c_str(), X_OK) == 0) return true;
  return false;
}

}  // namespace

void require_gnuplot() {
  if (!on_path("gnuplot"))
    throw usage_error("--plot: gnuplot is not on PATH (install it: apt-get install gnuplot-nox)");
}

void check_outputs(const config& cfg) {
  if (!cfg.plot_path.empty()) require_gnuplot();
  for (const std::string& path : {cfg.log_path, cfg.plot_path})
    if (!path.empty() && !std::ofstream(path, std::ios::app))
      throw usage_error(path + ": cannot write (" + std::strerror(errno) + ")");
}

void write_plot(const std::string& path, const std::string& title, const history& h) {
  if (path.find_first_of("\n\r") != std::string::npos)
    throw usage_error("--plot: the file name must not contain a line break");
  std::ostringstream s;
  // pngcairo draws smoother lines; plain png (libgd) is the fallback in minimal builds.
  s << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo size 900,720 } "
       "else { set terminal png size 900,720 }\n"
    << "set output " << quoted(path) << "\n";

  // Per-step loss is noisy: draw it faintly under a running mean of 50 steps.
  const double per_epoch = static_cast<double>(h.steps_per_epoch ? h.steps_per_epoch : 1);
  s << "$loss << EOD\n";
  double window_sum = 0.0;
  constexpr std::size_t window = 50;
  for (std::size_t i = 0; i < h.step_loss.size(); ++i) {
    window_sum += h.step_loss[i];
    if (i >= window) window_sum -= h.step_loss[i - window];
    const double mean = window_sum / static_cast<double>(i < window ? i + 1 : window);
    s << static_cast<double>(i + 1) / per_epoch << ' ' << h.step_loss[i] << ' ' << mean << '\n';
  }
  s << "EOD\n$accuracy << EOD\n";
  for (std::size_t e = 0; e < h.test_accuracy.size(); ++e)
    s << e + 1 << ' ' << h.test_accuracy[e] << ' ' << h.epoch_loss[e] << '\n';
  // Both panels span epochs 0..N so they line up; explicit ranges also keep gnuplot from
  // warning about an empty range after a single epoch.
  double low = 1.0, high = 0.0;
  for (double a : h.test_accuracy) low = std::min(low, a), high = std::max(high, a);
  if (low > high) low = 0.0, high = 1.0;
  low = std::max(0.0, low - 0.01);
  high = std::min(1.0, high + 0.01);
  s << "EOD\n"
    << "set xrange [0:" << std::max<std::size_t>(h.test_accuracy.size(), 1) << "]\n"
    << "set multiplot layout 2,1 title " << quoted(title) << "\n"
    << "set grid\nset xlabel 'epoch'\nset ylabel 'training loss'\nset logscale y\n"
    << "plot $loss using 1:2 with lines lc rgb '#b0c8e0' title 'per step', "
       "$loss using 1:3 with lines lw 2 lc rgb '#1f4e8c' title 'mean of 50 steps', "
       "$accuracy using 1:3 with points pt 7 lc rgb '#000000' title 'epoch mean'\n"
    << "unset logscale y\nset ylabel 'test accuracy'\nset key bottom right\n"
    << "set yrange [" << low << ":" << high << "]\n"
    << (h.test_accuracy.size() <= 20 ? "set xtics 1\n" : "")
    << "plot $accuracy using 1:2 with linespoints pt 7 lw 2 lc rgb '#b2182b' title 'test accuracy'\n"
    << "unset multiplot\n";

  // A gnuplot that dies early must not take this process down with SIGPIPE.
  const auto old = std::signal(SIGPIPE, SIG_IGN);
  // gnuplot falls back to stdout when it cannot open the output: keep that off our stdout.
  std::FILE* p = ::popen("gnuplot > /dev/null", "w");
  if (!p) {
    std::signal(SIGPIPE, old);
    throw std::runtime_error("--plot: cannot start gnuplot");
  }
  const std::string script = s.str();
  std::fwrite(script.data(), 1, script.size(), p);
  const int status = ::pclose(p);
  std::signal(SIGPIPE, old);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("--plot: gnuplot failed to write " + path + " (its messages are above)");
}

}  // namespace fmnist
