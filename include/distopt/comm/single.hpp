// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>

#include "../concepts.hpp"
#include "request.hpp"

namespace distopt {

/// A group of one rank: every collective is a local copy or nothing. The default communicator.
class single {
 public:
  using communicator_concept = communicator_tag;

  /// This rank's index: always 0.
  int rank() const noexcept { return 0; }
  /// The number of ranks: always 1.
  int size() const noexcept { return 1; }

  /// Reduce over one rank: the data is already the result (avg of one value is itself).
  template <class T>
  void all_reduce(std::span<T>, reduce_op) {}

  /// Gather every rank's `in` into `out`: with one rank, a copy.
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    check_sizes("all_gather", in.size(), out.size());
    if (in.data() != out.data()) std::copy(in.begin(), in.end(), out.begin());
  }

  /// Reduce `in` over ranks and keep this rank's slice in `out`: with one rank, a copy.
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op) {
    check_sizes("reduce_scatter", in.size(), out.size());
    if (in.data() != out.data()) std::copy(in.begin(), in.end(), out.begin());
  }

  /// Reduce `in` over ranks into the root's `out`: with one rank (the root, 0), a copy.
  template <class T>
  void reduce(std::span<const T> in, std::span<T> out, reduce_op, int root) {
    check_root("reduce", root);
    check_sizes("reduce", in.size(), out.size());
    if (in.data() != out.data()) std::copy(in.begin(), in.end(), out.begin());
  }

  /// Broadcast from `root`, which must be 0.
  template <class T>
  void broadcast(std::span<T>, int root) {
    check_root("broadcast", root);
  }

  /// Asynchronous forms: with one rank the work is done at once and the request is complete.
  template <class T>
  comm_request iall_reduce(std::span<T> data, reduce_op op) {
    all_reduce(data, op);
    return {};
  }
  template <class T>
  comm_request iall_gather(std::span<const T> in, std::span<T> out) {
    all_gather(in, out);
    return {};
  }
  template <class T>
  comm_request ireduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    reduce_scatter(in, out, op);
    return {};
  }
  template <class T>
  comm_request ireduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    reduce(in, out, op, root);
    return {};
  }
  template <class T>
  comm_request ibroadcast(std::span<T> data, int root) {
    broadcast(data, root);
    return {};
  }

  /// Bytes this rank has sent to others: none.
  std::size_t bytes_sent() const noexcept { return 0; }

 private:
  static void check_root(const char* what, int root) {
    if (root != 0)
      throw std::invalid_argument(std::string("distopt::single::") + what + ": root " + std::to_string(root) +
                                  " does not exist in a group of one rank");
  }
  static void check_sizes(const char* what, std::size_t in, std::size_t out) {
    if (in != out)
      throw std::invalid_argument(std::string("distopt::single::") + what + ": input has " +
                                  std::to_string(in) + " elements but output has " +
                                  std::to_string(out));
  }
};

}  // namespace distopt
