// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Loss and accuracy curves drawn by gnuplot, fed a generated script (data inline) on stdin,
// and the early check that the output files can be written.

#include <algorithm>
#include <sstream>
#include <string>

#include "fashion_mnist.hpp"
#include "gnuplot.hpp"

namespace fmnist {

void check_outputs(const config& cfg) {
  if (const std::string why = examples::output_problem(cfg.log_path, cfg.plot_path); !why.empty())
    throw usage_error(why);
}

void write_plot(const std::string& path, const std::string& title, const history& h) {
  std::ostringstream s;
  s << examples::gnuplot_png(path, 900, 720);

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
    << "set multiplot layout 2,1 title " << examples::gnuplot_quoted(title) << "\n"
    << "set grid\nset xlabel 'epoch'\nset ylabel 'training loss'\nset logscale y\n"
    << "plot $loss using 1:2 with lines lc rgb '#b0c8e0' title 'per step', "
       "$loss using 1:3 with lines lw 2 lc rgb '#1f4e8c' title 'mean of 50 steps', "
       "$accuracy using 1:3 with points pt 7 lc rgb '#000000' title 'epoch mean'\n"
    << "unset logscale y\nset ylabel 'test accuracy'\nset key bottom right\n"
    << "set yrange [" << low << ":" << high << "]\n"
    << (h.test_accuracy.size() <= 20 ? "set xtics 1\n" : "")
    << "plot $accuracy using 1:2 with linespoints pt 7 lw 2 lc rgb '#b2182b' title 'test accuracy'\n"
    << "unset multiplot\n";

  examples::run_gnuplot(s.str(), path);
}

}  // namespace fmnist
