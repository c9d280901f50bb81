// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The emulated device executor: its memory is closed to the host outside launches, copies
// and collectives (a host read faults, shown in a forked child), its views do not convert
// to host spans, and the optimizer run on it gives the CPU executor's bits: element-wise
// policies with fp32, bf16 and 8-bit states, fp32, bf16 and fp16 params, clipping, loss scaling,
// percentile clipping and fp32 grad reduction, one rank and d = 1..4 ranks as threads.
// The element-wise cases run also on device_code_only (emulated_code_only.cpp). The
// layer-wise policies are in emulated_layerwise.cpp.

#include "executor_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

using namespace distopt;
using namespace harness;

namespace {

/// Runs `f` in a forked child, with the default action for SIGSEGV and SIGBUS (Boost.Test
/// would catch them and go on running the suite in the child) and its output silenced;
/// true when the child did not exit normally with status 0.
template <class F>
bool child_fails(F f) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::signal(SIGSEGV, SIG_DFL);
    std::signal(SIGBUS, SIG_DFL);
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) {
      ::dup2(null, 1);
      ::dup2(null, 2);
    }
    f();
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int open_count() { return detail::device_arenas::instance().opened(); }

using device_adamw = optimizer<adamw, replicated<fp32>, single, emulated_device>;

}  // namespace

BOOST_AUTO_TEST_SUITE(emulated_device_executor)

BOOST_AUTO_TEST_CASE(its_views_are_device_spans_that_give_no_host_access) {
  static_assert(executor<emulated_device>);
  static_assert(!host_memory<emulated_device> && host_memory<cpu>);
  static_assert(!std::is_convertible_v<device_span<float>, std::span<float>>);
  static_assert(!std::is_constructible_v<std::span<float>, device_span<float>>);
  static_assert(std::is_convertible_v<device_span<float>, device_span<const float>>);
  static_assert(!std::is_convertible_v<device_span<const float>, device_span<float>>);
  static_assert(std::is_same_v<decltype(std::declval<device_adamw&>().param("")), device_span<float>>);
  static_assert(std::is_same_v<decltype(std::declval<device_adamw&>().grads()), device_span<float>>);
  static_assert(std::is_same_v<decltype(std::declval<device_adamw&>().local_state("", 0).values),
                               device_span<const float>>);
  static_assert(std::is_same_v<decltype(std::declval<optimizer<adamw>&>().param("")), std::span<float>>);
  const device_span<float> s(nullptr, 10);
  BOOST_TEST(s.subspan(4, 6).size() == 6u);
  BOOST_CHECK_THROW(s.subspan(4, 7), std::out_of_range);
}

BOOST_AUTO_TEST_CASE(memory_is_zeroed_and_open_only_inside_launches_copies_and_scopes) {
  emulated_device e(2);
  const std::size_t n = 10007;
  auto* p = static_cast<float*>(e.allocate_bytes(n * sizeof(float)));
  BOOST_TEST(open_count() == 0);
  // A child that reads host memory exits normally: the check below can fail.
  std::vector<float> host(n, 1.0f);
  BOOST_TEST(!child_fails([&] { volatile float x = host[5]; (void)x; }));
  BOOST_TEST(child_fails([&] { volatile float x = p[5]; (void)x; }));  // device memory: faults
  BOOST_TEST(child_fails([&] { p[n - 1] = 1.0f; }));

  e.copy_bytes(host.data(), p, n * sizeof(float));
  std::size_t nonzero = 0;
  for (float v : host) nonzero += v != 0.0f;
  BOOST_TEST(nonzero == 0u);

  std::vector<std::atomic<int>> seen(n);
  e.parallel_for(n, [&](std::size_t i) {
    seen[i].fetch_add(1);
    p[i] = static_cast<float>(i);  // a launch may
  });
  std::size_t wrong = 0;
  for (auto& v : seen) wrong += v.load() != 1;
  BOOST_TEST(wrong == 0u);
  download(e, device_span<const float>(p, n), std::span<float>(host));
  wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += host[i] != static_cast<float>(i);
  BOOST_TEST(wrong == 0u);
  BOOST_TEST(child_fails([&] { volatile float x = p[5]; (void)x; }));  // closed again

  {
    const auto open = e.open_memory();  // what a collective in flight holds
    BOOST_TEST(open_count() == 1);
    BOOST_TEST(p[7] == 7.0f);
    BOOST_TEST(!child_fails([&] { volatile float x = p[5]; (void)x; }));
  }
  BOOST_TEST(open_count() == 0);
  e.deallocate_bytes(p, n * sizeof(float));
}

BOOST_AUTO_TEST_CASE(an_exception_in_a_launch_reaches_the_caller_and_closes_the_memory) {
  emulated_device e(2);
  BOOST_CHECK_THROW(e.parallel_for(100,
                                   [](std::size_t i) {
                                     if (i == 17) throw std::runtime_error("item failed");
                                   }),
                    std::runtime_error);
  BOOST_TEST(open_count() == 0);
}

BOOST_AUTO_TEST_CASE(a_host_read_of_an_optimizer_view_faults_and_upload_download_do_not) {
  layout l;
  l.add("w", {64, 33}, dtype::f32);
  device_adamw opt(l, adamw::hyper_params{}, {}, emulated_device(2));
  std::vector<float> w(64 * 33, 0.25f), g(64 * 33, 0.5f);
  upload(opt.executor(), w, opt.param("w"));
  upload(opt.executor(), g, opt.grad("w"));
  BOOST_TEST(!opt.step().get().skipped);
  BOOST_TEST(open_count() == 0);
  BOOST_TEST(child_fails([&] { volatile float x = opt.param("w").data()[0]; (void)x; }));
  BOOST_TEST(child_fails([&] { opt.grad("w").data()[3] = 0.0f; }));
  download(opt.executor(), opt.param("w"), std::span<float>(w));
  BOOST_TEST(w[0] < 0.25f);  // one AdamW step moved it by about lr
  BOOST_TEST(std::abs(opt.state_values("w", 0)[0] - 0.05f) < 1e-8f);  // exp_avg = (1 - beta1) g
  std::vector<float> wrong_size(5);
  try {
    upload(opt.executor(), wrong_size, opt.param("w"));
    BOOST_FAIL("no exception");
  } catch (const std::invalid_argument& err) {
    BOOST_TEST(std::string(err.what()) == "distopt::upload: 5 elements into a view of 2112");
  }
}

// The step decided on the device (engine/decisions.hpp): after the first step, which
// copies the host's decisions state over, step() copies nothing between host and device
// (what a GPU's host thread would wait for), through a skipped step, the loss scaler's
// growth and backoff, and stochastic rounding. What it leaves and reports, read on
// demand, is the CPU executor's, bit for bit; a new hyper-parameter group is copied once.
BOOST_AUTO_TEST_CASE(a_step_decided_on_the_device_copies_nothing_and_reads_back_on_demand) {
  layout l;
  l.add("w", {130, 17}, dtype::bf16);
  l.add("b", {50}, dtype::bf16);
  adam::hyper_params h;
  h.lr = 1e-2;
  optimizer_options o;
  o.master_weights = false;  // bf16 params with stochastic rounding: the device's key
  o.loss_scale = dynamic_loss_scale{1024.0, 2.0, 0.5, 3};
  o.max_grad_norm = 4.0;  // the unscaled norms are 4.9 to 9.9 (and one Inf): every step clips
  using params = precision<bf16, bf16>;
  optimizer<adam, replicated<fp32>, single, emulated_device, params> dev(l, h, o, emulated_device(2));
  optimizer<adam, replicated<fp32>, single, cpu, params> host(l, h, o, cpu(2));
  const std::size_t n = dev.params().size();
  std::vector<bf16> p(n), g(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = from_float<bf16>(std::sin(0.37f * static_cast<float>(i)));
  upload(dev.executor(), std::span<const bf16>(p), dev.params());
  std::copy(p.begin(), p.end(), host.params().begin());
  std::vector<step_result> got, want;
  std::vector<std::size_t> copies;
  for (int s = 0; s < 9; ++s) {
    for (std::size_t i = 0; i < n; ++i) g[i] = from_float<bf16>(std::cos(0.11f * static_cast<float>(i * (s + 1))) * 300.0f);
    if (s == 4) g[77] = from_float<bf16>(INFINITY);  // skipped, the scale backs off
    if (s == 6) {  // a schedule: the new group is copied at the next step
      h.lr = 5e-3;
      dev.set_hyper(0, h);
      host.set_hyper(0, h);
    }
    upload(dev.executor(), std::span<const bf16>(g), dev.grads());
    std::copy(g.begin(), g.end(), host.grads().begin());
    const std::size_t before = detail::device_arenas::instance().copies();
    auto ticket = dev.step();
    copies.push_back(detail::device_arenas::instance().copies() - before);
    got.push_back(ticket.get());
    want.push_back(host.step());
  }
  for (std::size_t s = 0; s < copies.size(); ++s)
    BOOST_TEST_CONTEXT("step call " << s + 1) {
      if (s != 0 && s != 6) BOOST_TEST(copies[s] == 0u);  // the first step and new hyper-parameters copy
      BOOST_TEST(got[s].skipped == want[s].skipped);
      BOOST_TEST(got[s].found_inf == want[s].found_inf);
      BOOST_TEST(got[s].step == want[s].step);
      BOOST_TEST(got[s].loss_scale == want[s].loss_scale);
      BOOST_TEST(std::memcmp(&got[s].grad_norm, &want[s].grad_norm, sizeof(double)) == 0);
    }
  BOOST_TEST(copies[6] > 0u);
  BOOST_TEST(want[4].skipped);
  BOOST_TEST(want[3].loss_scale == 2048.0);  // grew after 3 clean steps
  BOOST_TEST(want[4].loss_scale == 1024.0);  // backed off
  BOOST_TEST(dev.step_count() == 8);
  BOOST_TEST(dev.loss_scale() == host.loss_scale());
  double on_device = 0.0;
  download(dev.executor(), dev.loss_scale_on_device(), std::span<double>(&on_device, 1));
  BOOST_TEST(on_device == host.loss_scale());
  std::vector<bf16> back(n);
  download(dev.executor(), dev.params(), std::span<bf16>(back));
  BOOST_TEST(std::memcmp(back.data(), host.params().data(), n * sizeof(bf16)) == 0);
  BOOST_TEST((dev.state_values("w", 1) == host.state_values("w", 1)));

  const auto old = dev.step();
  dev.step();
  try {
    (void)old.get();
    BOOST_FAIL("no exception");
  } catch (const std::logic_error& err) {
    BOOST_TEST(std::string(err.what()) ==
               "distopt::optimizer: the result of step() call 10 was read after call 11; read a step's result "
               "before the next step()");
  }
}

// The master weights are loaded at the first step taken, as on the host: a skipped first
// step loads nothing, so params written by hand after it are the ones the master takes.
BOOST_AUTO_TEST_CASE(master_weights_load_at_the_first_step_taken_on_the_device) {
  layout l;
  l.add("w", {40, 9}, dtype::bf16);
  using params = precision<bf16, bf16>;
  optimizer<adamw, replicated<fp32>, single, emulated_device, params> dev(l, adamw::hyper_params{}, {},
                                                                          emulated_device(1));
  optimizer<adamw, replicated<fp32>, single, cpu, params> host(l, adamw::hyper_params{}, {});
  const std::size_t n = dev.params().size();
  std::vector<bf16> p(n, from_float<bf16>(0.5f)), g(n, from_float<bf16>(0.25f));
  const auto put = [&](auto& opt, auto view, const std::vector<bf16>& v) {
    upload(opt.executor(), std::span<const bf16>(v), view);
  };
  put(dev, dev.params(), p);
  put(host, host.params(), p);
  g[3] = from_float<bf16>(NAN);
  put(dev, dev.grads(), g);
  put(host, host.grads(), g);
  BOOST_TEST(dev.step().get().skipped);
  BOOST_TEST(host.step().skipped);
  std::fill(p.begin(), p.end(), from_float<bf16>(-2.0f));  // new params, by hand
  g[3] = from_float<bf16>(0.25f);
  put(dev, dev.params(), p);
  put(host, host.params(), p);
  put(dev, dev.grads(), g);
  put(host, host.grads(), g);
  BOOST_TEST(!dev.step().get().skipped);
  BOOST_TEST(!host.step().skipped);
  std::vector<float> dev_master(40 * 9), host_master(40 * 9);
  download(dev.executor(), dev.local_master("w").values, std::span<float>(dev_master));
  download(host.executor(), host.local_master("w").values, std::span<float>(host_master));
  BOOST_TEST((dev_master == host_master));
  BOOST_TEST(host_master[0] < -1.9f);  // from the new params
}

BOOST_AUTO_TEST_CASE(an_optimizer_destroyed_with_collectives_in_flight_closes_the_memory_after_them) {
  layout l;
  l.add("w", {3000}, dtype::f32);
  l.add("b", {700}, dtype::f32);
  optimizer_options o;
  o.bucket_elems = 1000;  // several buckets, each reduce-scatter left in flight
  run_ranks(3, [&](threads& comm) {
    optimizer<adamw, sharded<fp32>, threads, emulated_device> opt(l, adamw::hyper_params{}, o, emulated_device(1),
                                                                   std::move(comm));
    opt.reduce_grads();
  });
  BOOST_TEST(open_count() == 0);
}

BOOST_AUTO_TEST_SUITE_END()

// The element-wise cases on the emulated device (emulated_element_wise.hpp); the same
// cases on it configured as distopt::cuda is are in emulated_code_only.cpp.
using element_wise_executors = std::tuple<emulated_device>;

BOOST_AUTO_TEST_SUITE(emulated_equals_cpu)

#include "emulated_element_wise.hpp"

BOOST_AUTO_TEST_CASE(adam_amsgrad_bf16_states_two_threads) {
  run_options ro;
  ro.threads = 2;
  check_executor<emulated_device, adam, bf16, precision<float>>({cases::adam_amsgrad()}, ro);
}

BOOST_AUTO_TEST_CASE(adamw_bf16_params_with_master_reduced_in_fp32) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  run_options ro;
  ro.clip = 2.0;
  ro.options.grad_reduce_in_fp32 = true;
  check_executor<emulated_device, adamw, fp32, precision<bf16, bf16>>({h}, ro, dtype::bf16);
}

BOOST_AUTO_TEST_SUITE_END()
