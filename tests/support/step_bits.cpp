// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Runs a fixed mixed-precision workload through every policy (element-wise, 8-bit states,
// layer-wise) and prints a hash of the resulting params and states. Built three times: with
// the function clones, the F16C conversions and the q8 VBMI decode and encode (the AVX-512
// clone on a CPU that has it), for AVX2 without them, and for the x86-64 baseline (both with
// DISTOPT_NO_TARGET_CLONES, DISTOPT_NO_F16C and DISTOPT_NO_Q8_AVX512), so ctest can check
// that every machine path gives the same bits. The
// three are compiled with -ffp-contract=fast, as a user's GNU-mode build would be: the
// clones must not contract. On a machine with AVX-512 a fourth program is built for
// x86-64-v4 without clones, with the library's -ffp-contract=off.
// `step-bits --path` prints which path the update loops take in this build on this CPU
// (first word avx512, avx2 or baseline), so the test can tell when programs run the same one.

#include <distopt/distopt.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

std::uint64_t fnv1a(std::uint64_t h, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

template <class Range>
std::uint64_t fnv1a(std::uint64_t h, const Range& r) {
  return fnv1a(h, std::data(r), std::size(r) * sizeof(*std::data(r)));
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
  std::vector<double> norms;
  for (int s = 0; s < 5; ++s) {
    for (auto& g : opt.grads()) g = distopt::from_float<Grad>(d(rng) * 0.1f);
    norms.push_back(opt.clip_grad_norm(50.0));  // the exact norm's block sums run on the clones too
    opt.step();
  }
  std::uint64_t hash = 0xcbf29ce484222325ull;
  hash = fnv1a(hash, norms);
  hash = fnv1a(hash, opt.params());
  for (int k = 0; k < Policy::state_slots(h); ++k)
    for (const char* t : {"a", "b"}) hash = fnv1a(hash, opt.state_values(t, k));
  return hash;
}

/// The update loops' machine path in this program on this CPU: "avx512", "avx2" or
/// "baseline", then why, and whether binary16 arrays take F16C.
std::string cpu_path() {
  const std::string suffix =
      std::string(distopt::detail::f16c_path() ? ", F16C conversions" : ", portable conversions") +
      (distopt::detail::q8_avx512::available() ? ", q8 AVX-512 VBMI decode and encode" : ", q8 portable decode and encode")
#ifdef STEP_BITS_BUILD
      + ", built " STEP_BITS_BUILD  // another build of the same path, kept apart by cpu_paths_agree
#endif
      ;
#if DISTOPT_HAS_CPU_CLONES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "avx512 (the x86-64-v4 clone, chosen at load time)" + suffix;
#if !defined(__AVX2__)
  if (!__builtin_cpu_supports("avx2")) return "baseline (the default clone: this CPU has no AVX2)" + suffix;
#endif
  return "avx2 (the AVX2 clone, chosen at load time)" + suffix;
#elif DISTOPT_HAS_CPU_DISPATCH
  const int level = distopt::detail::host_cpu_level();
  if (level == 2) return "avx512 (the x86-64-v4 version, chosen at run time)" + suffix;
  if (level == 1) return "avx2 (the AVX2 version, chosen at run time)" + suffix;
  return "baseline (the baseline version: this CPU has no AVX2)" + suffix;
#elif defined(__AVX512F__)
  return "avx512 (the compiler targets AVX-512, so there are no clones)" + suffix;
#elif defined(__AVX2__)
  return "avx2 (the compiler targets AVX2, no clones)" + suffix;
#else
  return "baseline (no clones: DISTOPT_NO_TARGET_CLONES, ThreadSanitizer with GCC, or not x86-64 Linux)" + suffix;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--path") == 0) {
    std::printf("%s\n", cpu_path().c_str());
    return 0;
  }
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
  std::printf("adamw fp16 master fp16 grads %016llx\n",
              (unsigned long long)run<distopt::adamw, float, fp16, fp16>(adamw, true));
  std::printf("adamw fp16 in place fp32 grads %016llx\n",
              (unsigned long long)run<distopt::adamw, float, fp16, float>(adamw, false));
  std::printf("adamw q8 bf16 master %016llx\n",
              (unsigned long long)run<distopt::adamw, distopt::q8, bf16, bf16>(adamw, true));
  std::printf("lamb fp32 %016llx\n",
              (unsigned long long)run<distopt::lamb, float, float, float>(distopt::lamb::hyper_params{}, true));
  distopt::adafactor::hyper_params adafactor;
  adafactor.beta1 = 0.9;
  std::printf("adafactor bf16 master %016llx\n",
              (unsigned long long)run<distopt::adafactor, float, bf16, bf16>(adafactor, true));
}
