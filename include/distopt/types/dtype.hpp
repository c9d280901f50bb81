// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The element types distopt stores parameters and state in, named at run time.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include <distopt/types/bf16.hpp>
#include <distopt/types/fp16.hpp>

namespace distopt {

/// A run-time tag for a storage element type.
enum class dtype : std::uint8_t {
  f32,   ///< IEEE binary32 (`float`)
  bf16,  ///< bfloat16 (`distopt::bf16`)
  f16,   ///< IEEE binary16 (`distopt::fp16`)
};

/// Models a floating-point element type distopt can store: float, bf16 or fp16.
template <class T>
concept number = std::same_as<T, float> || std::same_as<T, bf16> || std::same_as<T, fp16>;

/// An element type the communicators' collectives carry (threads, mpi, any_comm): the
/// numbers above and double.
template <class T>
concept comm_element = number<T> || std::same_as<T, double>;

/// The canonical name of `t`: "fp32", "bf16" or "fp16".
constexpr std::string_view dtype_name(dtype t) noexcept {
  switch (t) {
  case dtype::f32: return "fp32";
  case dtype::bf16: return "bf16";
  case dtype::f16: return "fp16";
  }
  return "unknown";
}

/// Bytes per element of `t`.
constexpr std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
  case dtype::f32: return 4;
  case dtype::bf16: return 2;
  case dtype::f16: return 2;
  }
  return 0;
}

/// Parses a dtype name (case-sensitive): "fp32", "f32", "float32", "bf16", "bfloat16",
/// "fp16", "f16" or "float16"; anything else gives nullopt.
constexpr std::optional<dtype> parse_dtype(std::string_view s) noexcept {
  if (s == "fp32" || s == "f32" || s == "float32") return dtype::f32;
  if (s == "bf16" || s == "bfloat16") return dtype::bf16;
  if (s == "fp16" || s == "f16" || s == "float16") return dtype::f16;
  return std::nullopt;
}

namespace detail {
/// Instantiated only for a T with no dtype, to say so readably.
template <class T>
consteval dtype no_dtype_for() {
  static_assert(sizeof(T) == 0, "distopt::dtype_of<T>: T is not a distopt::number (float, bf16, fp16)");
  return dtype::f32;
}
} // namespace detail

/// The dtype tag of element type `T`.
template <class T>
inline constexpr dtype dtype_of = detail::no_dtype_for<T>();
/// float is fp32.
template <>
inline constexpr dtype dtype_of<float> = dtype::f32;
/// bf16 is bf16.
template <>
inline constexpr dtype dtype_of<bf16> = dtype::bf16;
/// fp16 is fp16.
template <>
inline constexpr dtype dtype_of<fp16> = dtype::f16;

} // namespace distopt
