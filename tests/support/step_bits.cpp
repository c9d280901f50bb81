// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Runs a fixed mixed-precision workload through every policy and prints a hash of the
// resulting params and states. Built twice, with and without the AVX2 function clones
// (DISTOPT_NO_TARGET_CLONES), so ctest can check that both machine paths give the same bits.

#include <distopt/distopt.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

std::uint64_t fnv1a(std::uint64_t h, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

template <class Policy, class State, class Param, class Grad>
std::uint64_t run(typename Policy::hyper_params h, bool master) {
  distopt::layout l;
  l.add("a", {1000, 37}, distopt::dtype_of<Param>);
  l.add("b", {4097}, distopt::dtype_of<Param>);
  distopt::optimizer_options o;
  o.master_weights = master;
  o.seed = 7;
  distopt::optimizer<Policy, distopt::replicated<State>, distopt::single, distopt::cpu,
                     distopt::precision<Param, Grad>>
      opt(l, h, o, distopt::cpu(2));
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (auto& p : opt.params()) p = distopt::from_float<Param>(d(rng));
  for (int s = 0; s < 5; ++s) {
    for (auto& g : opt.grads()) g = distopt::from_float<Grad>(d(rng) * 0.1f);
    opt.clip_grad_norm(50.0);
    opt.step();
  }
  std::uint64_t hash = 0xcbf29ce484222325ull;
  hash = fnv1a(hash, opt.params().data(), opt.params().size_bytes());
  for (int k = 0; k < Policy::state_slots(h); ++k) {
    auto st = opt.state("a", k);
    hash = fnv1a(hash, st.data(), st.size_bytes());
  }
  return hash;
}

}  // namespace

int main() {
  using distopt::bf16;
  using distopt::fp16;
  distopt::adam::hyper_params adam;
  adam.amsgrad = true;
  adam.weight_decay = 0.01;
  distopt::sgd::hyper_params sgd;
  sgd.lr = 0.01;
  sgd.momentum = 0.9;
  sgd.nesterov = true;
  distopt::adamw::hyper_params adamw;
  distopt::lion::hyper_params lion;
  std::printf("adamw fp32 %016llx\n", (unsigned long long)run<distopt::adamw, float, float, float>(adamw, true));
  std::printf("adamw bf16 master %016llx\n", (unsigned long long)run<distopt::adamw, float, bf16, bf16>(adamw, true));
  std::printf("adamw bf16 states sr %016llx\n", (unsigned long long)run<distopt::adamw, bf16, bf16, bf16>(adamw, false));
  std::printf("adam amsgrad fp16 %016llx\n", (unsigned long long)run<distopt::adam, float, fp16, fp16>(adam, true));
  std::printf("sgd nesterov %016llx\n", (unsigned long long)run<distopt::sgd, float, float, bf16>(sgd, true));
  std::printf("lion bf16 %016llx\n", (unsigned long long)run<distopt::lion, bf16, bf16, float>(lion, false));
}
