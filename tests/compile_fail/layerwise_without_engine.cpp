// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with: "a layer-wise policy needs #include <distopt/engine/layerwise.hpp>".
// A user's layer-wise policy whose header includes only optimizer.hpp and layerwise.hpp:
// the engine that runs its phases lives in its own header (so that element-wise optimizers
// never parse it), and forgetting it is named, not an incomplete-type error.
#include <array>
#include <cstdint>
#include <span>
#include <string_view>

#include <distopt/layerwise.hpp>
#include <distopt/optimizer.hpp>

struct one_phase {
  static constexpr std::string_view name = "one_phase";
  static constexpr int max_state_slots = 0;
  struct hyper_params {
    double lr = 1e-3;
    void validate() const {}
  };
  struct scalars {
    float lr;
  };
  static int state_slots(const hyper_params&) { return 0; }
  static scalars prepare(const hyper_params& h, const distopt::step_info&) { return {static_cast<float>(h.lr)}; }
  static constexpr std::array<distopt::phase_spec, 1> phases{distopt::phase_spec{.writes_param = true}};
  static constexpr int tensor_values = 0, row_values = 0, col_values = 0, row_states = 0, col_states = 0;
  static bool factored(const hyper_params&, std::span<const std::int64_t>) { return false; }
  static bool uses_slot(const hyper_params&, int, bool) { return false; }
  template <int Phase, bool Factored>
  static void element(const scalars& s, const distopt::element_stats&, float& param, float grad, float*, float*) {
    param -= s.lr * grad;
  }
  template <int Phase>
  static void finish(const hyper_params&, const scalars&, distopt::tensor_stats&) {}
};

int main() {
  distopt::layout l;
  l.add("w", {64, 64}, distopt::dtype::f32);
  distopt::optimizer<one_phase> opt(l, one_phase::hyper_params{});
}
