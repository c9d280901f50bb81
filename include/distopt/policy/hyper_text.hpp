// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Hyper-parameters as text, by the reference implementation's argument names:
/// `set_hyper_param(h, "betas", "0.9,0.95")` and `hyper_params_string(h)`. Used by the
/// command-line tools and checkpoints.

#include <array>
#include <optional>
#include <charconv>
#include <cmath>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include "hyper_params.hpp"

namespace distopt {

namespace detail {

/// A decimal (or 0x hexadecimal) number, as Python's float() and strtod in the "C" locale
/// read it, whatever the process's locale: std::from_chars, after blanks around it and a
/// leading '+' (which from_chars does not take).
inline bool parse_double(std::string_view text, double& out) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  const bool minus = !text.empty() && text.front() == '-';
  if (!text.empty() && (text.front() == '+' || minus)) text.remove_prefix(1);
  if (text.empty() || text.front() == '+' || text.front() == '-') return false;
  auto format = std::chars_format::general;
  if (text.size() > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) {
    text.remove_prefix(2);
    format = std::chars_format::hex;
  }
  double v = 0.0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v, format);
  if (ec != std::errc{} || p != text.data() + text.size()) return false;
  out = minus ? -v : v;
  return true;
}

template <class M>
inline constexpr bool is_optional_double = std::is_same_v<M, std::optional<double>>;

template <class M>
bool parse_into(std::string_view text, M& out) {
  if constexpr (std::is_same_v<M, bool>) {
    if (text == "true" || text == "True" || text == "1") return out = true, true;
    if (text == "false" || text == "False" || text == "0") return out = false, true;
    return false;
  } else if constexpr (std::is_same_v<M, double>) {
    return parse_double(text, out);
  } else if constexpr (is_optional_double<M>) {  // None (as Python spells it) or a number
    if (text == "None" || text == "none" || text == "null") return out.reset(), true;
    double v = 0.0;
    if (!parse_double(text, v)) return false;
    return out = v, true;
  } else if constexpr (std::is_integral_v<M>) {
    auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
    return ec == std::errc{} && p == text.data() + text.size();
  } else {  // std::array<double, N>: a comma list, optionally in parentheses
    if (text.size() >= 2 && text.front() == '(' && text.back() == ')')
      text = text.substr(1, text.size() - 2);
    std::size_t i = 0;
    for (;;) {
      const auto comma = text.find(',');
      if (i == out.size() || !parse_double(text.substr(0, comma), out[i++])) return false;
      if (comma == std::string_view::npos) break;
      text.remove_prefix(comma + 1);
    }
    return i == out.size();
  }
}

/// Parses `text` into `out`; leaves `out` unchanged when the text is malformed.
template <class M>
bool parse_value(std::string_view text, M& out) {
  M parsed = out;
  if (!parse_into(text, parsed)) return false;
  out = parsed;
  return true;
}

template <class M>
std::string expected_form() {
  if constexpr (std::is_same_v<M, bool>) return "true or false";
  else if constexpr (std::is_same_v<M, double>) return "a number";
  else if constexpr (is_optional_double<M>) return "a number or None";
  else if constexpr (std::is_integral_v<M>) return "an integer";
  else return std::to_string(std::tuple_size_v<M>) + " comma-separated numbers";
}

template <class M>
std::string value_string(const M& v) {
  if constexpr (std::is_same_v<M, bool>) return v ? "true" : "false";
  else if constexpr (std::is_same_v<M, double>) return format_number(v);
  else if constexpr (is_optional_double<M>) return v ? format_number(*v) : std::string("None");
  else if constexpr (std::is_integral_v<M>) return std::to_string(v);
  else {
    std::string s;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i) s += ',';  // appended separately: GCC 12 warns (-Wrestrict) on "," + string
      s += format_number(v[i]);
    }
    return s;
  }
}

}  // namespace detail

/// Sets the hyper-parameter called `key` from its text form (numbers, true/false, comma
/// lists for tuples). Throws std::invalid_argument naming the policy, the key and, for an
/// unknown key, the known ones. Does not validate ranges: call `h.validate()` after.
template <class Policy>
void set_hyper_param(typename Policy::hyper_params& h, std::string_view key,
                     std::string_view value) {
  bool found = false;
  std::string known;
  std::apply(
      [&](const auto&... f) {
        ((known += known.empty() ? "" : ", ", known += f.name,
          f.name == key ? (found = true,
                           detail::parse_value(value, h.*(f.member))
                               ? void()
                               : throw std::invalid_argument(
                                     std::string(Policy::name) + ": hyper-parameter '" +
                                     std::string(key) + "' expects " +
                                     detail::expected_form<
                                         std::remove_cvref_t<decltype(h.*(f.member))>>() +
                                     ", got '" + std::string(value) + "'"))
                        : void()),
         ...);
      },
      Policy::hyper_params::fields());
  if (!found)
    throw std::invalid_argument(std::string(Policy::name) + ": unknown hyper-parameter '" +
                                std::string(key) + "' (known: " + known + ")");
}

/// Applies `--set KEY=VALUE` style settings in order to `h`, then validates the result.
/// Throws std::invalid_argument whose message starts with "KEY=VALUE: " for a setting that
/// does not parse, or is the policy's own message for a value out of range.
template <class Policy, class Settings>
typename Policy::hyper_params apply_hyper_params(typename Policy::hyper_params h,
                                                 const Settings& settings) {
  for (const auto& [key, value] : settings) {
    try {
      set_hyper_param<Policy>(h, key, value);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string(key) + "=" + std::string(value) + ": " + e.what());
    }
  }
  h.validate();
  return h;
}

/// "lr=0.001 betas=0.9,0.999 ..." in declaration order; `set_hyper_param` reads it back.
template <class Policy>
std::string hyper_params_string(const typename Policy::hyper_params& h) {
  std::string s;
  std::apply(
      [&](const auto&... f) {
        // Appended piece by piece: GCC 12 warns (-Wrestrict) on "literal" + std::string.
        ((s += s.empty() ? "" : " ", s += f.name, s += '=', s += detail::value_string(h.*(f.member))),
         ...);
      },
      Policy::hyper_params::fields());
  return s;
}

}  // namespace distopt
