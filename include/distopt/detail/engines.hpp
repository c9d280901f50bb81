// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The parts of distopt::optimizer that only some policies and encodings use, each
/// defined in its own header and included by the header that names what needs it:
///   layer_engine       detail/layer_engine.hpp       (layer-wise policies: lamb.hpp, adafactor.hpp, came.hpp)
///   projection_engine  detail/projection_engine.hpp  (projecting policies: galore_adamw.hpp)
///   q8_engine          detail/q8_engine.hpp          (8-bit states: storage/q8.hpp)
///   muon_engine        detail/muon_engine.hpp        (orthogonalising policies: muon.hpp)
/// An optimizer that does not need a part holds a no_engine in its place and never parses
/// or compiles it.

#include <type_traits>

namespace distopt::detail {

struct no_engine {};

struct layer_engine_tag {};
template <class Policy, class State, class Exec>
struct layer_engine;

struct q8_engine_tag {};
template <class Policy, class Exec>
struct q8_engine;

struct projection_engine_tag {};
template <class Policy, class State, class Exec>
struct projection_engine;

struct muon_engine_tag {};
template <class Policy, class State>
struct muon_engine;

/// True once the header defining the engine `Tag` is included (each one specialises it).
template <class Policy, class Tag>
struct engine_included : std::false_type {};

}  // namespace distopt::detail
