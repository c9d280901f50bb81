// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Helpers shared by the policies' hyper-parameter structs: named fields (for
/// `--set KEY=VALUE`, checkpoints and messages) and argument checks.

#include <array>
#include <span>
#include <charconv>
#include <cmath>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>

#include "../config.hpp"

namespace distopt {

/// One named hyper-parameter: a name as the reference implementation spells it and a
/// pointer to the member. Policies list theirs in `hyper_params::fields()`.
template <class Struct, class Member>
struct hyper_field {
  /// Named, so that nvcc's host pass does not print it back as `Member (Struct::*member)`,
  /// which GCC warns about (-Wparentheses).
  using member_pointer = Member Struct::*;
  std::string_view name;
  member_pointer member;
};

/// Thrown for a hyper-parameter outside its valid range; the message names the policy and the argument.
class invalid_hyper_parameter : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
/// The shortest text that reads back as the same double ("0.9", not "0.90000000000000002").
DISTOPT_CORE_FN std::string format_number(double v);
}  // namespace detail

// Argument checks for hyper_params::validate(), public so that user policies share them.

/// Throws invalid_hyper_parameter "POLICY: invalid ARG VALUE: WHY" unless `ok`.
DISTOPT_CORE_FN void require(bool ok, std::string_view policy, std::string_view arg, double value,
                             std::string_view why);
/// lr >= 0 and finite.
DISTOPT_CORE_FN void require_lr(std::string_view policy, double lr);
/// weight_decay >= 0 and finite.
DISTOPT_CORE_FN void require_weight_decay(std::string_view policy, double wd);
/// Each beta in [0, 1).
DISTOPT_CORE_FN void require_betas(std::string_view policy, std::span<const double> betas);

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN std::string detail::format_number(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

DISTOPT_CORE_FN void require(bool ok, std::string_view policy, std::string_view arg, double value,
                             std::string_view why) {
  if (!ok)
    throw invalid_hyper_parameter(std::string(policy) + ": invalid " + std::string(arg) + " " +
                                  detail::format_number(value) + ": " + std::string(why));
}

DISTOPT_CORE_FN void require_lr(std::string_view policy, double lr) {
  require(std::isfinite(lr) && lr >= 0.0, policy, "lr", lr, "must be a finite value >= 0");
}

DISTOPT_CORE_FN void require_weight_decay(std::string_view policy, double wd) {
  require(std::isfinite(wd) && wd >= 0.0, policy, "weight_decay", wd, "must be a finite value >= 0");
}

DISTOPT_CORE_FN void require_betas(std::string_view policy, std::span<const double> betas) {
  for (std::size_t i = 0; i < betas.size(); ++i)
    require(betas[i] >= 0.0 && betas[i] < 1.0, policy, "betas[" + std::to_string(i) + "]", betas[i],
            "must be in [0, 1)");
}
#endif  // DISTOPT_CORE_BODIES

}  // namespace distopt
