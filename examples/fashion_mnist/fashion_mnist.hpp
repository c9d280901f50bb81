// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// distopt-fashion-mnist: the run configuration, the data set, the training history, and
// one training entry point per policy (each in its own translation unit, so that the
// optimizer instantiations build in parallel).

#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fmnist {

/// Where Debian's dataset-fashion-mnist package puts the gzipped idx files.
inline constexpr const char* default_data_dir = "/usr/share/datasets/fashion-mnist";

/// A bad command line or unusable input: printed as one line, exit code 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// --comm mpi: another process refused the run and printed why; this one exits with
/// code 2 and says nothing, so that the reason is printed once.
struct refused_elsewhere : std::exception {
  const char* what() const noexcept override { return "another rank refused the run"; }
};

/// What to run; defaults are the ones the README's numbers were measured with.
struct config {
  std::string optimizer = "adamw";
  std::vector<std::pair<std::string, std::string>> sets;  // --set KEY=VALUE, in order
  std::string param_dtype = "fp32";
  std::string state = "fp32";  // fp32, or q8 (8-bit block-wise states; element-wise policies)
  std::vector<int> hidden{512, 256};
  int epochs = 10;
  int batch_size = 128;
  int threads = -1;       // per rank; -1: not given (2 threads per process, split over its ranks)
  int ranks = 0;          // --ranks; 0: not given (one rank, or the MPI world size)
  int tp = 1;             // --tp: tensor-parallel ranks per data-parallel rank (threads only)
  std::string comm = "threads";  // threads: ranks as threads of this process; mpi: one per process
  int zero = 0;           // --zero: the ZeRO stage (1-3), with the overlap hooks; 0: not given
  bool offload = false;   // --offload: ZeRO-Offload (params and grads on the emulated device), with --zero
  int accumulate = 1;     // --accumulate N: micro-batches per step (gradient accumulation)
  bool accumulate_each = false;  // --accumulate-schedule each: reduced each micro-batch (else after the last)
  std::string backend = "cpu";   // the optimizer's executor: cpu, kokkos or cuda (one rank)
  std::uint64_t seed = 0;
  std::string data_dir = default_data_dir;
  std::string log_path, plot_path;
  std::size_t limit = 0;  // 0: every training sample
  double clip = 0.0;      // max grad norm; 0: no clipping
  bool normalize = true;  // subtract the training mean, divide by the training std
  std::string checkpoint_dir;  // --checkpoint DIR: save there every --checkpoint-every steps and at the end
  int checkpoint_every = 0;
  std::string resume_dir;      // --resume DIR: load, then continue from its step
};

/// Images as floats, one row of `pixels` per sample, and labels 0..9.
struct split {
  std::size_t count = 0;
  std::vector<float> images;
  std::vector<std::uint8_t> labels;
};

struct dataset {
  std::size_t pixels = 0;
  split train, test;
};

/// Reads the four idx files under cfg.data_dir, applies --limit and scales pixels to [0, 1]
/// (then to zero mean, unit variance with --normalize on). Throws usage_error naming the
/// file for anything missing or malformed.
dataset load_dataset(const config& cfg);

/// What the plot and the summary need.
struct history {
  std::size_t steps_per_epoch = 0;
  std::vector<float> step_loss;         // one per optimizer step
  std::vector<double> epoch_loss;       // mean training loss per epoch
  std::vector<double> test_accuracy;    // after each epoch
};

/// Checks the hyper-parameters, loads the data, trains and prints the results. With
/// --comm mpi the caller has initialised MPI; every process returns the same history.
history train_sgd(const config&);
history train_adam(const config&);
history train_adamw(const config&);
history train_lion(const config&);
history train_lamb(const config&);
history train_adafactor(const config&);
history train_came(const config&);
history train_galore_adamw(const config&);
history train_muon(const config&);
/// --backend cuda (train_cuda.cu, a build with CUDA): one rank on GPU 0, adamw or adafactor.
history train_cuda(const config&);

/// Fails early (usage_error) when --plot needs gnuplot and it is missing, or when the
/// --log or --plot file cannot be written. Run by the process that writes them.
void check_outputs(const config& cfg);
/// Draws the loss and test-accuracy curves into a PNG by running gnuplot.
void write_plot(const std::string& path, const std::string& title, const history& h);

}  // namespace fmnist
