// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The `nccl` communicator across ranks: one rank per GPU (nccl::init_all over every
// visible device, up to 8), each driven by a thread of its own. Every collective x
// element type x op against results computed on the host from every rank's input:
// all-reduce (sum, avg, max), reduce-scatter, all-gather and broadcast from a root other
// than 0, blocking and asynchronous, out of place and in place; split into two groups; the
// byte model. Inputs are multiples of 1/8 in [-2, 2], so every sum is exact in every
// element type and in any order: sum and max must match bit for bit, avg (NCCL may
// divide, or multiply by 1/d) to one rounding.
//
// Exits 77, which ctest reports as skipped, where there are fewer than two CUDA devices
// (one GPU cannot hold two NCCL ranks). A plain main() rather than Boost.Test, for that
// exit code and because the ranks are threads.

#include "nccl_test_support.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <mutex>
#include <thread>

namespace {

using namespace nccl_test;
using distopt::comm_request;
using distopt::nccl;

std::atomic<int> checks{0};
std::mutex report_mutex;
std::vector<std::string> failures;

void check(bool ok, int rank, const std::string& what) {
  ++checks;
  if (ok) return;
  const std::lock_guard<std::mutex> lock(report_mutex);
  failures.push_back("rank " + std::to_string(rank) + ": " + what);
}

/// Rank r's input: multiples of 1/8 in [-2, 2] (exact in bf16 and fp16, and so are sums of
/// up to 8 of them).
template <class T>
std::vector<T> rank_input(std::size_t n, int rank, std::uint64_t seed) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t h = splitmix((seed * 8 + static_cast<std::uint64_t>(rank)) * 1000003u + i);
    const double x = static_cast<double>(static_cast<int>(h % 33) - 16) / 8.0;
    if constexpr (std::is_same_v<T, double>) v[i] = x;
    else v[i] = T(static_cast<float>(x));
  }
  return v;
}

template <class T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) return x;
  else return static_cast<double>(distopt::to_float(x));
}

/// One rounding of the element type at `x`: the spacing of its significand.
template <class T>
double rounding(double x) {
  const int digits = std::is_same_v<T, double> ? 53 : std::is_same_v<T, float> ? 24 : std::is_same_v<T, bf16> ? 8 : 11;
  return std::ldexp(std::max(std::fabs(x), 1e-3), 1 - digits);
}

/// The reduction of element i over every rank's input, in double (exact for these inputs).
template <class T>
double reduce_at(const std::vector<std::vector<T>>& inputs, std::size_t i, reduce_op op) {
  double acc = as_double(inputs[0][i]);
  for (std::size_t q = 1; q < inputs.size(); ++q)
    acc = op == reduce_op::max ? std::max(acc, as_double(inputs[q][i])) : acc + as_double(inputs[q][i]);
  return op == reduce_op::avg ? acc / static_cast<double>(inputs.size()) : acc;
}

/// `got` equals the reduction of `inputs` at elements [first, first + got.size()): bit for
/// bit for sum and max (exact), within one rounding for avg.
template <class T>
bool reduced(const std::vector<T>& got, const std::vector<std::vector<T>>& inputs, std::size_t first, reduce_op op) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double want = reduce_at(inputs, first + i, op), g = as_double(got[i]);
    if (op == reduce_op::avg ? !(std::fabs(g - want) <= rounding<T>(want)) : g != want) return false;
  }
  return true;
}

/// Every collective on chunks of `m` elements of T, on rank c.rank() of c.size().
template <class T>
void collectives(nccl& c, std::size_t m, std::uint64_t seed) {
  const int rank = c.rank();
  const std::size_t d = static_cast<std::size_t>(c.size()), r = static_cast<std::size_t>(rank);
  const std::string tag = type_name<T>() + " m=" + std::to_string(m) + " d=" + std::to_string(d);
  std::vector<std::vector<T>> inputs(d);  // every rank's input, known to every rank
  for (std::size_t q = 0; q < d; ++q) inputs[q] = rank_input<T>(d * m, static_cast<int>(q), seed);
  const std::vector<T>& mine = inputs[r];
  device_buffer<T> full(d * m), part(m);

  for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
    const std::string what = op_name(op) + " " + tag;
    full.upload(mine);
    c.all_reduce(full.span(), op);
    check(reduced(full.download(), inputs, 0, op), rank, "all_reduce " + what);
    full.upload(mine);
    comm_request req = c.iall_reduce(full.span(), op);
    req.wait();
    check(reduced(full.download(), inputs, 0, op), rank, "iall_reduce " + what);

    // Rank r gets the reduction of chunk r.
    full.upload(mine);
    part.poison();
    c.reduce_scatter(full.cspan(), part.span(), op);
    check(reduced(part.download(), inputs, r * m, op), rank, "reduce_scatter " + what);
    part.poison();
    req = c.ireduce_scatter(full.cspan(), part.span(), op);
    req.wait();
    check(reduced(part.download(), inputs, r * m, op), rank, "ireduce_scatter " + what);
    c.reduce_scatter(full.cspan(), full.span().subspan(r * m, m), op);  // in place
    const std::vector<T> all = full.download();
    check(reduced(std::vector<T>(all.begin() + static_cast<std::ptrdiff_t>(r * m),
                                 all.begin() + static_cast<std::ptrdiff_t>((r + 1) * m)),
                  inputs, r * m, op),
          rank, "in-place reduce_scatter " + what);
  }

  // All-gather: chunk q of the result is rank q's first m elements.
  const auto gathered = [&](const std::vector<T>& got) {
    for (std::size_t q = 0; q < d; ++q)
      if (std::memcmp(got.data() + q * m, inputs[q].data(), m * sizeof(T)) != 0) return false;
    return true;
  };
  part.upload(std::vector<T>(mine.begin(), mine.begin() + static_cast<std::ptrdiff_t>(m)));
  full.poison();
  c.all_gather(part.cspan(), full.span());
  check(gathered(full.download()), rank, "all_gather " + tag);
  full.poison();
  comm_request req = c.iall_gather(part.cspan(), full.span());
  req.wait();
  check(gathered(full.download()), rank, "iall_gather " + tag);
  std::vector<T> slot(d * m, T(0.0f));  // in place: this rank's slice holds its input
  std::copy(mine.begin(), mine.begin() + static_cast<std::ptrdiff_t>(m), slot.begin() + static_cast<std::ptrdiff_t>(r * m));
  full.upload(slot);
  c.all_gather(std::span<const T>(full.span().subspan(r * m, m)), full.span());
  check(gathered(full.download()), rank, "in-place all_gather " + tag);

  // Broadcast from the last rank (a root other than 0).
  const int root = c.size() - 1;
  full.upload(mine);
  c.broadcast(full.span(), root);
  check(same_bits(full.download(), inputs[static_cast<std::size_t>(root)]), rank, "broadcast " + tag);
  full.upload(mine);
  req = c.ibroadcast(full.span(), root);
  req.wait();
  check(same_bits(full.download(), inputs[static_cast<std::size_t>(root)]), rank, "ibroadcast " + tag);
}

/// One rank's whole run.
void rank_main(nccl& c) {
  cuda(cudaSetDevice(c.device()), "cudaSetDevice");  // this thread's device
  const int rank = c.rank();
  for (std::size_t m : {std::size_t{1}, std::size_t{7}, std::size_t{4097}, std::size_t{1} << 18}) {
    collectives<float>(c, m, 1);
    collectives<double>(c, m, 2);
    collectives<bf16>(c, m, 3);
    collectives<fp16>(c, m, 4);
  }

  // The byte model of an all-reduce: (N + (d - 2) * this rank's chunk) * sizeof(T).
  const std::size_t n = 4099, d = static_cast<std::size_t>(c.size()), r = static_cast<std::size_t>(rank);
  device_buffer<float> buf(n);
  buf.upload(rank_input<float>(n, rank, 5));
  const std::size_t before = c.bytes_sent();
  c.all_reduce(buf.span(), reduce_op::sum);
  const std::size_t chunk = n / d + (r < n % d ? 1 : 0);
  check(c.bytes_sent() - before == (n + (d - 2) * chunk) * sizeof(float), rank,
        "bytes_sent() of an all_reduce is " + std::to_string(c.bytes_sent() - before));

  // Split by parity: each group reduces over its own ranks only.
  nccl sub = c.split(rank % 2, rank);
  const int members = (c.size() - rank % 2 + 1) / 2;
  check(sub.size() == members && sub.rank() == rank / 2, rank,
        "split: rank " + std::to_string(sub.rank()) + " of " + std::to_string(sub.size()));
  device_buffer<float> one(1);
  one.upload({static_cast<float>(rank + 1)});
  sub.all_reduce(one.span(), reduce_op::sum);
  float want = 0;
  for (int q = rank % 2; q < c.size(); q += 2) want += static_cast<float>(q + 1);
  check(one.download()[0] == want, rank, "split: the sum over ranks of parity " + std::to_string(rank % 2));
}

int run(int count) {
  std::vector<int> devices(static_cast<std::size_t>(std::min(count, 8)));
  for (std::size_t i = 0; i < devices.size(); ++i) devices[i] = static_cast<int>(i);
  std::vector<nccl> group = nccl::init_all(devices);
  std::vector<std::thread> ranks;
  for (nccl& c : group)
    ranks.emplace_back([&c] {
      try {
        rank_main(c);
      } catch (const std::exception& e) {
        // The other ranks may now wait in a collective forever: report and leave at once.
        std::cerr << "nccl_multi_rank: FAILED with an exception on rank " << c.rank() << ": " << e.what() << "\n";
        std::_Exit(1);
      }
    });
  for (std::thread& t : ranks) t.join();
  for (const std::string& f : failures) std::cerr << "nccl_multi_rank: FAILED: " << f << "\n";
  std::cout << "nccl_multi_rank: " << group.size() << " ranks on " << group.size() << " GPUs: "
            << checks - static_cast<int>(failures.size()) << " of " << checks << " checks passed\n";
  return failures.empty() ? 0 : 1;
}

}  // namespace

int main() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count < 2) {
    std::cout << "nccl_multi_rank: skipped: needs two or more CUDA devices, found "
              << (e != cudaSuccess ? std::string("none (cudaGetDeviceCount: ") + cudaGetErrorName(e) + ")"
                                   : std::to_string(count))
              << "\n";
    return 77;
  }
  try {
    return run(count);
  } catch (const std::exception& ex) {
    std::cerr << "nccl_multi_rank: FAILED with an exception: " << ex.what() << "\n";
    return 1;
  }
}
