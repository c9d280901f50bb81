// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// What the examples' --plot shares: gnuplot found on PATH, its quoting, and a script (data
// inline) fed to it on stdin.

#include <sys/wait.h>
#include <unistd.h>

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

namespace examples {

/// A gnuplot single-quoted string: only the quote itself needs escaping (doubled).
inline std::string gnuplot_quoted(std::string_view s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

inline bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (::access(((dir.empty() ? "." : dir) + "/" + program).c_str(), X_OK) == 0) return true;
  return false;
}

/// Why a run's --log and --plot files could not be written, checked before it trains: no
/// gnuplot on PATH, a plot name with a line break (gnuplot's script could not quote it), a
/// file that cannot be opened. Empty when they can.
inline std::string output_problem(const std::string& log_path, const std::string& plot_path) {
  if (!plot_path.empty() && !on_path("gnuplot"))
    return "--plot: gnuplot is not on PATH (install it: apt-get install gnuplot-nox)";
  if (plot_path.find_first_of("\n\r") != std::string::npos)
    return "--plot: the file name must not contain a line break";
  for (const std::string& path : {log_path, plot_path})
    if (!path.empty() && !std::ofstream(path, std::ios::app)) return path + ": cannot write (" + std::strerror(errno) + ")";
  return {};
}

/// The lines that make gnuplot write a PNG to `path` (pngcairo where it has it, plain png
/// otherwise); output_problem has refused a name with a line break.
inline std::string gnuplot_png(const std::string& path, int width, int height) {
  const std::string size = " size " + std::to_string(width) + "," + std::to_string(height);
  return "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo" + size +
         " } else { set terminal png" + size + " }\nset output " + gnuplot_quoted(path) + "\n";
}

/// Runs gnuplot on `script`; throws std::runtime_error naming `path` when it fails.
inline void run_gnuplot(const std::string& script, const std::string& path) {
  // A gnuplot that dies early must not take this process down with SIGPIPE.
  const auto old = std::signal(SIGPIPE, SIG_IGN);
  // gnuplot falls back to stdout when it cannot open the output: keep that off our stdout.
  std::FILE* p = ::popen("gnuplot > /dev/null", "w");
  if (!p) {
    std::signal(SIGPIPE, old);
    throw std::runtime_error("--plot: cannot start gnuplot");
  }
  std::fwrite(script.data(), 1, script.size(), p);
  const int status = ::pclose(p);
  std::signal(SIGPIPE, old);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("--plot: gnuplot failed to write " + path + " (its messages are above)");
}

}  // namespace examples
