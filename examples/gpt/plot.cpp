// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// --plot: the training loss per step (with a running mean) and the validation loss.

#include <sstream>
#include <stdexcept>
#include <string>

#include "gnuplot.hpp"
#include "gpt.hpp"

namespace gpt {

void check_outputs(const config& cfg) {
  if (const std::string why = examples::output_problem(cfg.log_path, cfg.plot_path); !why.empty())
    throw usage_error(why);
}

void write_plot(const std::string& path, const std::string& title, const history& h) {
  std::ostringstream s;
  s << examples::gnuplot_png(path, 900, 540);
  s << "$train << EOD\n";
  double window_sum = 0.0;
  constexpr std::size_t window = 20;
  for (std::size_t i = 0; i < h.train_loss.size(); ++i) {
    window_sum += h.train_loss[i];
    if (i >= window) window_sum -= h.train_loss[i - window];
    s << h.first_step + i + 1 << ' ' << h.train_loss[i] << ' ' << window_sum / static_cast<double>(i < window ? i + 1 : window) << '\n';
  }
  s << "EOD\n$val << EOD\n";
  for (const auto& [step, loss] : h.val_loss) s << step << ' ' << loss << '\n';
  s << "EOD\n"
    << "set title " << examples::gnuplot_quoted(title) << "\nset grid\nset xlabel 'step'\n"
    << "set ylabel 'cross-entropy (nats a byte)'\n"
    << "plot $train using 1:2 with lines lc rgb '#b0c8e0' title 'training, per step', "
       "$train using 1:3 with lines lw 2 lc rgb '#1f4e8c' title 'training, mean of the last 20 steps', "
       "$val using 1:2 with linespoints pt 7 lw 2 lc rgb '#b2182b' title 'validation'\n";
  examples::run_gnuplot(s.str(), path);
}

}  // namespace gpt
