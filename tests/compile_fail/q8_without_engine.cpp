// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with: "8-bit states need #include <distopt/storage/q8.hpp>".
// storage/replicated.hpp names the q8 tag (storage/q8_encoding.hpp) without the maps and
// the 8-bit engine, so that fp32 and bf16 optimizers never parse them; an optimizer with
// q8 states and without storage/q8.hpp is told which header it lacks.
#include <distopt/optimizer.hpp>
#include <distopt/policy/adamw.hpp>
#include <distopt/storage/replicated.hpp>

int main() {
  distopt::layout l;
  l.add("w", {64, 64}, distopt::dtype::f32);
  distopt::optimizer<distopt::adamw, distopt::replicated<distopt::q8>> opt(l, distopt::adamw::hyper_params{});
}
