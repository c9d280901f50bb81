// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The `nccl` communicator on one rank and one GPU: ONE-RANK PLUMBING ONLY. With one rank
// every collective's result is a copy of its input, so an in-place all-reduce or broadcast
// that did nothing would pass here; the arithmetic across ranks is nccl_multi_rank.cpp's
// (ctest nccl.multi_rank, on machines with two or more GPUs). What this checks: every
// collective x element type x op returns the values uploaded (out-of-place results land
// in poisoned buffers), the in-place and asynchronous forms, the four ways to make a
// handle, split, the byte model (0 for one rank) and the local size checks. Exits 77,
// which ctest reports as skipped, where there is no CUDA device.
//
// A plain main() rather than Boost.Test, so that the skip is an exit code decided before
// anything touches NCCL. Results are read back with a plain cudaMemcpy, which does not
// wait for the communicator's non-blocking stream: a collective that returned before its
// work was done shows up as a wrong result, not as a lucky pass.

#include <distopt/comm/mesh.hpp>

#include "nccl_test_support.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iostream>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace nccl_test;
using distopt::bf16;
using distopt::comm_request;
using distopt::fp16;
using distopt::nccl;
using distopt::reduce_op;

static_assert(distopt::communicator<nccl>, "distopt::nccl must model distopt::communicator");
static_assert(distopt::async_communicator<nccl>, "distopt::nccl must model distopt::async_communicator");
static_assert(!std::is_copy_constructible_v<nccl> && std::is_nothrow_move_constructible_v<nccl>);
static_assert(distopt::splittable_communicator<nccl>, "distopt::make_mesh must build its groups over distopt::nccl");

constexpr std::size_t sizes[] = {1, 7, 4097, 1u << 20};
constexpr reduce_op ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::max};

int failures = 0;
int checks = 0;

void check(bool ok, const std::string& what) {
  ++checks;
  if (ok) return;
  ++failures;
  std::cerr << "nccl_comm: FAILED: " << what << "\n";
}

/// Runs `f`, which must throw E with exactly `message` (or containing it, if `exact` is false).
template <class E, class F>
void check_throws(F&& f, const std::string& message, bool exact = true) {
  try {
    f();
  } catch (const E& e) {
    const std::string what = e.what();
    check(exact ? what == message : what.find(message) != std::string::npos,
          "expected the message \"" + message + "\", got \"" + what + "\"");
    return;
  } catch (const std::exception& e) {
    check(false, "expected \"" + message + "\", got another exception: " + e.what());
    return;
  }
  check(false, "expected \"" + message + "\", nothing was thrown");
}

/// Waits for `r` by polling test() (at most a minute), then wait().
void poll_then_wait(comm_request& r, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (!r.test()) {
    if (std::chrono::steady_clock::now() > deadline) {
      check(false, what + ": test() still false after a minute");
      break;
    }
  }
  r.wait();
  check(!r.pending() && r.test(), what + ": request still pending after wait()");
}

/// Every collective on `n` elements of T, blocking and asynchronous, out of place and in place.
template <class T>
void collectives(nccl& c, std::size_t n) {
  const std::string tag = type_name<T>() + " n=" + std::to_string(n);
  const std::vector<T> x = make_input<T>(n, n * 31 + sizeof(T));
  device_buffer<T> in(n), out(n);

  for (reduce_op op : ops) {
    in.upload(x);
    c.all_reduce(in.span(), op);
    check(same_bits(in.download(), x), "all_reduce " + op_name(op) + " " + tag + " is not the input");
    in.upload(x);
    comm_request r = c.iall_reduce(in.span(), op);
    poll_then_wait(r, "iall_reduce " + tag);
    check(same_bits(in.download(), x), "iall_reduce " + op_name(op) + " " + tag + " is not the input");

    in.upload(x);
    out.poison();
    c.reduce_scatter(in.cspan(), out.span(), op);
    {
      const auto got = out.download();
      check(same_bits(got, x), "reduce_scatter " + op_name(op) + " " + tag + " is not the input" + difference(got, x));
    }
    out.poison();
    r = c.ireduce_scatter(in.cspan(), out.span(), op);
    r.wait();
    {
      const auto got = out.download();
      check(same_bits(got, x), "ireduce_scatter " + op_name(op) + " " + tag + " is not the input" + difference(got, x));
    }
    // In place: out is this rank's slice of in (all of it, with one rank).
    c.reduce_scatter(in.cspan(), in.span().subspan(static_cast<std::size_t>(c.rank()) * n, n), op);
    check(same_bits(in.download(), x), "in-place reduce_scatter " + op_name(op) + " " + tag);

    out.poison();
    c.reduce(in.cspan(), out.span().subspan(0, n), op, 0);
    {
      const auto got = out.download();
      check(same_bits(got, x), "reduce " + op_name(op) + " " + tag + " is not the input" + difference(got, x));
    }
    out.poison();
    r = c.ireduce(in.cspan(), out.span().subspan(0, n), op, 0);
    r.wait();
    {
      const auto got = out.download();
      check(same_bits(got, x), "ireduce " + op_name(op) + " " + tag + " is not the input" + difference(got, x));
    }
    c.reduce(in.cspan(), in.span(), op, 0);  // in place on the root
    check(same_bits(in.download(), x), "in-place reduce " + op_name(op) + " " + tag);
  }

  in.upload(x);
  out.poison();
  c.all_gather(in.cspan(), out.span());
  check(same_bits(out.download(), x), "all_gather " + tag + " is not the input");
  out.poison();
  comm_request r = c.iall_gather(in.cspan(), out.span());
  r.wait();
  check(same_bits(out.download(), x), "iall_gather " + tag + " is not the input");
  // In place: in is this rank's slice of out.
  out.upload(x);
  c.all_gather(std::span<const T>(out.span().subspan(static_cast<std::size_t>(c.rank()) * n, n)), out.span());
  check(same_bits(out.download(), x), "in-place all_gather " + tag);

  in.upload(x);
  c.broadcast(in.span(), 0);
  check(same_bits(in.download(), x), "broadcast " + tag);
  r = c.ibroadcast(in.span(), 0);
  r.wait();
  check(same_bits(in.download(), x), "ibroadcast " + tag);
}

/// Several requests in flight at once, finished with wait_all.
template <class T>
void overlapping_requests(nccl& c) {
  const std::size_t n = 4097;
  const std::vector<T> a = make_input<T>(n, 1), b = make_input<T>(n, 2);
  device_buffer<T> da(n), db(n), dg(n);
  da.upload(a);
  db.upload(b);
  dg.poison();
  comm_request r1 = c.iall_reduce(da.span(), reduce_op::sum);
  comm_request r2 = c.ibroadcast(db.span(), 0);
  comm_request r3 = c.iall_gather(da.cspan(), dg.span());
  distopt::wait_all(r1, r2, r3);
  check(same_bits(da.download(), a) && same_bits(db.download(), b) && same_bits(dg.download(), a),
        "three requests in flight (" + type_name<T>() + ")");
}

/// Zero elements: nothing is enqueued, nothing is thrown, the requests are complete.
void empty_collectives(nccl& c) {
  std::span<float> none;
  c.all_reduce(none, reduce_op::sum);
  c.all_gather(std::span<const float>(none), none);
  c.reduce_scatter(std::span<const float>(none), none, reduce_op::max);
  c.broadcast(none, 0);
  comm_request r = c.iall_reduce(none, reduce_op::avg);
  check(!r.pending(), "iall_reduce of nothing returned a pending request");
  r = c.iall_gather(std::span<const float>(none), none);
  check(!r.pending(), "iall_gather of nothing returned a pending request");
}

/// The local checks: sizes, roots, partial overlaps, split colors.
void errors(nccl& c) {
  device_buffer<float> buf(16);
  const std::span<float> all = buf.span();
  const std::span<const float> call = buf.cspan();
  check_throws<std::invalid_argument>([&] { c.all_gather(call.subspan(0, 4), all.subspan(8, 7)); },
                                      "distopt::nccl::all_gather: out has 7 elements but size() * in = 1 * 4 = 4");
  check_throws<std::invalid_argument>([&] { (void)c.iall_gather(call.subspan(0, 4), all.subspan(8, 7)); },
                                      "distopt::nccl::all_gather: out has 7 elements but size() * in = 1 * 4 = 4");
  check_throws<std::invalid_argument>(
      [&] { c.reduce_scatter(call.subspan(0, 7), all.subspan(8, 4), reduce_op::sum); },
      "distopt::nccl::reduce_scatter: in has 7 elements but size() * out = 1 * 4 = 4");
  check_throws<std::invalid_argument>(
      [&] { (void)c.ireduce_scatter(call.subspan(0, 7), all.subspan(8, 4), reduce_op::avg); },
      "distopt::nccl::reduce_scatter: in has 7 elements but size() * out = 1 * 4 = 4");
  check_throws<std::invalid_argument>([&] { c.broadcast(all, 1); },
                                      "distopt::nccl::broadcast: root 1 does not exist in a group of 1 ranks");
  check_throws<std::invalid_argument>([&] { c.reduce(call.subspan(0, 4), all.subspan(8, 4), reduce_op::sum, 1); },
                                      "distopt::nccl::reduce: root 1 does not exist in a group of 1 ranks");
  check_throws<std::invalid_argument>([&] { (void)c.ireduce(call.subspan(0, 4), all.subspan(8, 3), reduce_op::max, 0); },
                                      "distopt::nccl::reduce: out has 3 elements on the root but in has 4");
  check_throws<std::invalid_argument>([&] { (void)c.ibroadcast(all, -1); },
                                      "distopt::nccl::broadcast: root -1 does not exist in a group of 1 ranks");
  check_throws<std::invalid_argument>([&] { c.all_gather(call.subspan(0, 4), all.subspan(2, 4)); },
                                      "distopt::nccl::all_gather: in overlaps out but is not this rank's slice of it");
  check_throws<std::invalid_argument>(
      [&] { c.reduce_scatter(call.subspan(0, 4), all.subspan(3, 4), reduce_op::sum); },
      "distopt::nccl::reduce_scatter: out overlaps in but is not this rank's slice of it");
  check_throws<std::invalid_argument>([&] { (void)c.split(-1, 0); },
                                      "distopt::nccl::split: color must be >= 0, got -1");
}

/// An NCCL failure names the call and the rank. A moved-from handle holds a null comm,
/// which NCCL refuses before launching anything (a bad device pointer, by contrast, would
/// fault on the GPU and spoil the context for the rest of the run).
void nccl_failure(nccl& c) {
  nccl taken = std::move(c);
  device_buffer<float> buf(4);
  check_throws<std::runtime_error>([&] { c.all_reduce(buf.span(), reduce_op::sum); },
                                   "distopt::nccl: ncclAllReduce failed on rank 0: ", false);
  check_throws<std::runtime_error>([&] { (void)c.ibroadcast(buf.span(), 0); },
                                   "distopt::nccl: ncclBroadcast failed on rank 0: ", false);
  c = std::move(taken);
}

/// Runs the whole suite on one handle.
template <class... Ts>
void suite(nccl& c, const std::string& label) {
  check(c.rank() == 0 && c.size() == 1, label + ": rank " + std::to_string(c.rank()) + " of " +
                                            std::to_string(c.size()) + ", expected 0 of 1");
  for (std::size_t n : sizes) (collectives<Ts>(c, n), ...);
  (overlapping_requests<Ts>(c), ...);
  empty_collectives(c);
  check(c.bytes_sent() == 0, label + ": bytes_sent() is " + std::to_string(c.bytes_sent()) + " for one rank");
}

int run() {
  int device = 0;
  cuda(cudaGetDevice(&device), "cudaGetDevice");
  int version = 0;
  nccl_call(ncclGetVersion(&version), "ncclGetVersion");
  std::cout << "nccl_comm: NCCL " << version / 10000 << "." << version / 100 % 100 << "." << version % 100 << "\n";

  // ncclCommInitAll over this one device: the main suite, split and the error paths.
  const int devices[] = {device};
  std::vector<nccl> group = nccl::init_all(devices);
  check(group.size() == 1, "init_all over one device made " + std::to_string(group.size()) + " handles");
  nccl& c = group.front();
  check(c.device() == device, "init_all: device() is " + std::to_string(c.device()));
  suite<float, double, bf16, fp16>(c, "init_all");

  {
    nccl sub = c.split(0, 0);
    check(sub.comm() != c.comm() && sub.stream() == c.stream(), "split: a new comm on the parent's stream");
    suite<float, bf16>(sub, "split(0, 0)");
    nccl moved = std::move(sub);
    collectives<fp16>(moved, 7);
  }
  collectives<float>(c, 7);  // the parent still works, and its stream is alive
  errors(c);
  nccl_failure(c);
  collectives<float>(c, 7);  // and still works after it was moved out and back
  check(c.bytes_sent() == 0, "bytes_sent() after the error paths");

  // init_rank over a unique id, with a stream of its own.
  ncclUniqueId id;
  nccl_call(ncclGetUniqueId(&id), "ncclGetUniqueId");
  {
    nccl r = nccl::init_rank(id, 1, 0);
    suite<float>(r, "init_rank");
  }
  check_throws<std::invalid_argument>([&] { (void)nccl::init_rank(id, 2, 2); },
                                      "distopt::nccl::init_rank: rank 2 does not exist in a group of 2 ranks");

  // Borrowed: the comm and the stream outlive the handle and stay usable.
  cudaStream_t stream = nullptr;
  cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  ncclComm_t raw = nullptr;
  nccl_call(ncclGetUniqueId(&id), "ncclGetUniqueId");
  nccl_call(ncclCommInitRank(&raw, 1, id, 0), "ncclCommInitRank");
  {
    nccl borrowed(raw, stream);
    check(borrowed.comm() == raw && borrowed.stream() == stream, "the borrowing constructor keeps the handles");
    suite<double>(borrowed, "borrowed");
  }
  int count = 0;
  check(ncclCommCount(raw, &count) == ncclSuccess && count == 1, "a borrowed comm was destroyed with its handle");
  check(cudaStreamQuery(stream) == cudaSuccess, "a borrowed stream was destroyed with its handle");
  {
    nccl adopted = nccl::adopt(raw, stream);  // destroys raw
    collectives<float>(adopted, 4097);
  }
  cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
  check_throws<std::invalid_argument>([] { nccl n(nullptr, nullptr); }, "distopt::nccl: the communicator is null");
  return 0;
}

}  // namespace

int main() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::cout << "nccl_comm: skipped: no CUDA device ("
              << (e != cudaSuccess ? std::string("cudaGetDeviceCount: ") + cudaGetErrorName(e) + ": " +
                                         cudaGetErrorString(e)
                                   : std::string("cudaGetDeviceCount found 0 devices"))
              << ")\n";
    return 77;
  }
  try {
    run();
  } catch (const std::exception& ex) {
    std::cerr << "nccl_comm: FAILED with an exception: " << ex.what() << "\n";
    return 1;
  }
  std::cout << "nccl_comm: one-rank plumbing only (a collective that does nothing passes on one rank; "
               "nccl.multi_rank checks the results across ranks): "
            << checks - failures << " of " << checks << " checks passed\n";
  return failures == 0 ? 0 : 1;
}
