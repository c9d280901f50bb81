// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file function_ref<R(Args...)>: a callable passed down a call, not kept: a pointer to the
/// caller's object and a function that calls it. Where std::function instantiated a
/// manager, an invoker and type information for each callable type (and may allocate), this
/// instantiates one small function: the thread pool's jobs and the layout check's
/// all-gather take it.

#include <memory>
#include <type_traits>
#include <utility>

namespace distopt::detail {

template <class Signature>
class function_ref;

template <class R, class... Args>
class function_ref<R(Args...)> {
 public:
  /// Refers to `f`, which must outlive every call (a temporary lives to the end of the
  /// full-expression that passes it).
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, function_ref> && std::is_invocable_r_v<R, F&, Args...>)
  function_ref(F&& f) noexcept  // NOLINT(google-explicit-constructor): passed like a std::function
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace distopt::detail
