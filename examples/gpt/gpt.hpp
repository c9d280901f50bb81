// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// distopt-gpt's command line and what its parts share.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "data.hpp"
#include "model.hpp"

namespace gpt {

/// A refusal of the command line: printed with the usage hint, exit code 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct config {
  std::string optimizer = "adafactor";
  std::string backend = "cpu";       // cpu (OpenBLAS, ranks as threads or processes) or cuda (one GPU)
  std::vector<std::pair<std::string, std::string>> sets;  // --set KEY=VALUE, in order
  model_config model;
  int batch = 16;          // sequences per step, over every data-parallel rank
  int steps = 300;
  int eval_every = 50;     // steps between validation losses (and at the end)
  int eval_batches = 4;    // validation batches of --batch sequences
  int ranks = 1;           // every rank: tensor-parallel x data-parallel
  int tp = 1;
  int zero = 0;            // the ZeRO stage with the hooks unit by unit; 0: stage 1 without hooks
  std::string comm = "threads";      // threads: ranks as threads of this process; mpi: one per process
  std::string param_dtype = "fp32";  // fp32, or bf16 with fp32 master weights
  std::string state = "fp32";        // fp32, or q8 (8-bit block-wise states; adamw)
  int accumulate = 1;                // --accumulate N: micro-batches a step (gradient accumulation)
  bool accumulate_each = false;      // --accumulate-schedule each: reduced after each (else after the last)
  int threads = -1;        // per rank; -1: 2 per process, split over its ranks
  std::uint64_t seed = 0;
  std::string data_dir = default_corpus_dir;
  std::string init_path;     // --init FILE: initial weights (safetensors), else drawn from --seed
  std::string batches_path;  // --batches FILE: the training batches (safetensors), else drawn from the corpus
  std::string save_init_dir; // --save-init DIR: write init.safetensors and batches.safetensors, then stop
  std::string dump_grads_path;  // --dump-grads FILE: the first step's gradients (safetensors)
  std::string log_path, plot_path;
  std::string expect_path;   // --expect FILE: the per-step training losses to match (reference JSON or --log CSV)
  double rtol = 1e-4;        // --rtol: their tolerance, relative
  std::string checkpoint_dir, resume_dir;
  std::size_t resume_step = 0;  // --resume: the step of the run's record (check_run_record)
  int checkpoint_every = 0;
};

/// The training history every rank returns (rank 0's is printed).
struct history {
  std::size_t first_step = 0;                     // a resumed run's: the checkpoint's step
  std::vector<double> train_loss;                 // per step from first_step
  std::vector<std::pair<int, double>> val_loss;   // (step, loss)
};

/// Trains with --optimizer's policy; each is a translation unit of its own (train_<name>.cpp).
history train_adamw(const config& cfg);
history train_adafactor(const config& cfg);
history train_lamb(const config& cfg);
history train_came(const config& cfg);
history train_galore_adamw(const config& cfg);
history train_muon(const config& cfg);
/// --backend cuda: one GPU, --optimizer adafactor or adamw (train_cuda.cu).
history train_cuda(const config& cfg);

/// --checkpoint: writes the run's record beside the checkpoint saved after `step` steps (the
/// flags a resumed run must repeat: --data, --batches, --batch, --seed, --optimizer and the
/// model's). --resume: refuses (usage_error, naming the flag) a run whose flags differ from the
/// record's, or a checkpoint without one; returns the record's step, which the checkpoint's
/// must equal (train.hpp checks it after loading).
void write_run_record(const config& cfg, std::size_t step);
std::size_t check_run_record(const config& cfg);

/// --plot: the loss curves as a PNG drawn by gnuplot.
void write_plot(const std::string& path, const std::string& title, const history& h);
/// Refuses, before training, outputs that cannot be written (and --plot without gnuplot).
void check_outputs(const config& cfg);

}  // namespace gpt
