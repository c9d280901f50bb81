// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The four concepts an optimizer is assembled from, each split into named parts so
/// that a failed check names the missing piece.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

#include "comm/request.hpp"
#include "layerwise.hpp"
#include "space.hpp"
#include "storage/q8_encoding.hpp"
#include "step_info.hpp"
#include "types/dtype.hpp"

namespace distopt {

/// Opt-in tags: storage, communicators and executors declare what they model.
struct storage_tag {};
struct communicator_tag {};
struct executor_tag {};

/// Reduction operations a communicator offers.
enum class reduce_op { sum, avg, max };


// ---------------------------------------------------------------------------------------
// optimizer_policy: the math of one optimizer.
//
// A policy is a plain struct:
//   static constexpr std::string_view name;
//   static constexpr int max_state_slots;         // fp32 values of state per element, at most
//   static constexpr int min_state_slots;         // optional (default 0): the fewest any
//                                                 // hyper_params use; loops are built for min..max
//   struct hyper_params { ...; void validate() const; };   // the reference's argument names
//   struct scalars { ... };                       // per-step, per-group values, trivially copyable
//   static int state_slots(const hyper_params&);  // slots in use for these hyper-parameters
//   static scalars prepare(const hyper_params&, const step_info&);   // on the host, in double
//   DISTOPT_HD static void update(const scalars&, float& param, float grad, float* state);
// ---------------------------------------------------------------------------------------

/// The policy names itself and says how much per-element state it keeps.
template <class P>
concept policy_declares_state = requires {
  { P::name } -> std::convertible_to<std::string_view>;
  { P::max_state_slots } -> std::convertible_to<int>;
} && (P::max_state_slots >= 0) && (P::max_state_slots <= 4);

/// A policy's min_state_slots, 0 where it declares none: the element loops are instantiated
/// for min_state_slots..max_state_slots slots only (each count is a loop of its own).
template <class P, class = void>
struct min_state_slots_of {
  static constexpr int value = 0;
};
template <class P>
struct min_state_slots_of<P, std::void_t<decltype(P::min_state_slots)>> {
  static constexpr int value = P::min_state_slots;
  static_assert(value >= 0 && value <= P::max_state_slots, "min_state_slots must lie in 0..max_state_slots");
};

/// The policy keeps its hyper-parameters in a default-constructible struct that validates itself.
template <class P>
concept policy_has_hyper_params = requires(const typename P::hyper_params& h) {
  h.validate();
  { P::state_slots(h) } -> std::convertible_to<int>;
} && std::default_initializable<typename P::hyper_params>;

/// The policy turns hyper-parameters and the step number into per-step scalars.
template <class P>
concept policy_prepares_scalars =
    std::is_trivially_copyable_v<typename P::scalars> &&
    requires(const typename P::hyper_params& h, const step_info& si) {
      { P::prepare(h, si) } -> std::same_as<typename P::scalars>;
    };

/// The policy updates one element: its fp32 param (taken by non-const reference, so that
/// the update is written back), its fp32 grad and its state slots.
template <class P>
concept policy_updates_elements =
    requires(const typename P::scalars& s, float& param, float grad, float* state) {
      P::update(s, param, grad, state);
    } && !requires(const typename P::scalars& s, float grad, float* state) {
      P::update(s, 0.0f, grad, state);  // an update that accepts an rvalue param loses its result
    };

/// A layer-wise policy (Lamb, Adafactor, CAME; see layerwise.hpp) instead declares the
/// phases of its step and the statistics they need (its header includes
/// engine/layerwise.hpp, which runs them):
///   static constexpr std::array<phase_spec, K> phases;       // K >= 1 passes
///   static constexpr int tensor_values, row_values, col_values;   // read by element<>
///   static constexpr int row_states, col_states;             // persistent, factored tensors
///   static bool factored(const hyper_params&, std::span<const std::int64_t> shape);
///   static bool uses_slot(const hyper_params&, int slot, bool factored);
///   static constexpr unsigned factored_slots;   // optional: slots a factored tensor may keep,
///                                               // or std::array<unsigned, N>: the sets it may
///                                               // keep, smallest first
///   template <int Phase, bool Factored> DISTOPT_HD static void element(
///       const scalars&, const element_stats&, float& param, float grad, float* state,
///       float* sums);                                      // sums: tensor, row, col
///   template <int Phase> static void finish(const hyper_params&, const scalars&, tensor_stats&);
///   template <int Phase> static void update_factors(...same...);   // optional
template <class P>
concept policy_is_layerwise =
    requires {
      { P::phases.size() } -> std::convertible_to<std::size_t>;
      { P::phases[0] } -> std::convertible_to<phase_spec>;
      { P::tensor_values } -> std::convertible_to<int>;
      { P::row_values } -> std::convertible_to<int>;
      { P::col_values } -> std::convertible_to<int>;
      { P::row_states } -> std::convertible_to<int>;
      { P::col_states } -> std::convertible_to<int>;
    } &&
    requires(const typename P::hyper_params& h, std::span<const std::int64_t> shape,
             const typename P::scalars& s, const element_stats& e, float& p, float g, float* st,
             float* out, tensor_stats& t) {
      { P::factored(h, shape) } -> std::same_as<bool>;
      { P::uses_slot(h, 0, true) } -> std::same_as<bool>;
      P::template element<0, true>(s, e, p, g, st, out);
      P::template element<0, false>(s, e, p, g, st, out);
      P::template finish<0>(h, s, t);
    } &&
    (P::row_states <= 4) && (P::col_states <= 4) && (P::row_values <= 4) && (P::col_values <= 4);

/// Models the math of an optimizer: hyper-parameters, per-element state, per-step
/// scalars and either the `DISTOPT_HD` per-element update or the phases of a layer-wise
/// step. Plain structs model it; no tag needed.
template <class P>
concept optimizer_policy = policy_declares_state<P> && policy_has_hyper_params<P> &&
                           policy_prepares_scalars<P> &&
                           (policy_updates_elements<P> || policy_is_layerwise<P>);

// ---------------------------------------------------------------------------------------
// state_storage: where optimizer state lives and how it is encoded.
// ---------------------------------------------------------------------------------------

/// How optimizer state can be stored (decoded to fp32 for the update): a number type, or
/// a quantized encoding such as distopt::q8 (8-bit codes with a scale per block).
template <class E>
concept state_encoding = number<E> || quantized_encoding<E>;

/// Policies that update the tensors of some groups as whole matrices through a low-rank
/// projection (GaLore) name their projector type here; the projector's header
/// (policy/galore_adamw.hpp) specialises it. `void`: an ordinary element-wise policy.
template <class P>
struct matrix_projector {
  using type = void;
};
template <class P>
inline constexpr bool projects_matrices = !std::is_void_v<typename matrix_projector<P>::type>;

/// Policies that update the tensors of some groups as whole matrices orthogonalised by
/// Newton–Schulz (Muon) name their orthogonaliser type here; the policy's header
/// (policy/muon.hpp) specialises it. `void`: no such groups.
template <class P>
struct matrix_orthogonalizer {
  using type = void;
};
template <class P>
inline constexpr bool orthogonalizes_matrices = !std::is_void_v<typename matrix_orthogonalizer<P>::type>;

/// Whether state slot `k` of policy P never holds a negative value (a second moment), so
/// that 8-bit states use the unsigned map for it. Policies say so with
/// `static constexpr bool nonnegative_slot(int k)`; without it every slot is signed.
template <class P>
constexpr bool state_slot_nonnegative(int k) {
  if constexpr (requires { P::nonnegative_slot(0); }) return P::nonnegative_slot(k);
  else return false;
}

/// Models the placement and encoding of optimizer state. Opt in with
/// `using storage_concept = distopt::storage_tag;`, name the `encoding`, and say
/// whether the state is sharded over data-parallel ranks.
template <class S>
concept state_storage = std::same_as<typename S::storage_concept, storage_tag> &&
                        state_encoding<typename S::encoding> &&
                        requires {
                          { S::is_sharded } -> std::convertible_to<bool>;
                        };

/// Whether storage S places whole matrices on one rank each (`owned`): it says so with
/// `static constexpr bool owns_matrices = true`.
template <class S>
constexpr bool storage_owns_matrices() {
  if constexpr (requires { S::owns_matrices; }) return S::owns_matrices;
  else return false;
}

/// Storage S's ZeRO stage: 0 for replicated state, 1 for sharded state (full params and
/// grads on every rank), 2 when the grads are sharded too, 3 when the params are too. A storage says so with
/// `static constexpr int zero_stage`; without it, 1 when sharded and 0 otherwise.
template <class S>
constexpr int storage_zero_stage() {
  if constexpr (requires { S::zero_stage; }) return S::zero_stage;
  else return S::is_sharded ? 1 : 0;
}

/// A storage that can hold the state of policy P.
template <class S, class P>
concept state_storage_for = state_storage<S> && optimizer_policy<P>;

// ---------------------------------------------------------------------------------------
// communicator: the collectives over the data-parallel group.
// ---------------------------------------------------------------------------------------

/// Models a group of ranks with collectives over spans. Opt in with
/// `using communicator_concept = distopt::communicator_tag;`.
template <class C>
concept communicator =
    std::same_as<typename C::communicator_concept, communicator_tag> &&
    requires(C& c, const C& cc, std::span<float> f, std::span<double> d,
             std::span<const float> cf, reduce_op op, int root) {
      { cc.rank() } -> std::convertible_to<int>;
      { cc.size() } -> std::convertible_to<int>;
      c.all_reduce(f, op);
      c.all_reduce(d, op);
      c.all_gather(cf, f);
      c.reduce_scatter(cf, f, op);
      c.reduce(cf, f, op, root);
      c.broadcast(f, root);
      { cc.bytes_sent() } -> std::convertible_to<std::size_t>;
    };

/// A communicator that also starts collectives asynchronously: the `i`-forms return a
/// `comm_request` to wait on, and the buffers stay untouched until then.
template <class C>
concept async_communicator =
    communicator<C> &&
    requires(C& c, std::span<float> f, std::span<const float> cf, reduce_op op, int root) {
      { c.iall_reduce(f, op) } -> std::same_as<comm_request>;
      { c.iall_gather(cf, f) } -> std::same_as<comm_request>;
      { c.ireduce_scatter(cf, f, op) } -> std::same_as<comm_request>;
      { c.ireduce(cf, f, op, root) } -> std::same_as<comm_request>;
      { c.ibroadcast(f, root) } -> std::same_as<comm_request>;
    };

// ---------------------------------------------------------------------------------------
// executor: memory space, allocation, how element ranges are visited.
// ---------------------------------------------------------------------------------------

/// A callable an executor runs for each item index; a named archetype for the concept check.
struct index_function_archetype {
  void operator()(std::size_t) const {}
};

/// Models an execution backend. Opt in with `using executor_concept = distopt::executor_tag;`,
/// name its `memory_space` (host_space or device_space), allocate and free bytes, and run
/// an index function over [0, n) (each index exactly once, in any order and any thread).
/// An executor whose memory the host cannot touch also copies bytes between its memory
/// and the host's (either direction, or within its own): `copy_bytes(dst, src, n)`.
template <class E>
concept executor =
    std::same_as<typename E::executor_concept, executor_tag> &&
    requires { typename E::memory_space; } &&
    requires(E& e, const E& ce, std::size_t n, void* p, index_function_archetype f) {
      { e.allocate_bytes(n) } -> std::same_as<void*>;
      e.deallocate_bytes(p, n);
      e.parallel_for(n, f);
      { ce.concurrency() } -> std::convertible_to<int>;
    } &&
    (std::same_as<typename E::memory_space, host_space> ||
     requires(E& e, void* dst, const void* src, std::size_t n) { e.copy_bytes(dst, src, n); });

/// True when the host reads and writes the executor's memory directly.
template <class E>
inline constexpr bool host_memory = std::is_same_v<typename E::memory_space, host_space>;

/// True when executor E can page-lock host memory that its copies read or write:
/// `register_host(p, bytes)` until `unregister_host(p)` (cuda: cudaHostRegister, so that a
/// copy runs at the link's speed instead of through the driver's staging buffer;
/// emulated_device: a registry its copies check). ZeRO-Offload registers the host buffers
/// it copies to and from.
template <class E>
concept registers_host_memory = requires(E& e, void* p, std::size_t n) {
  e.register_host(p, n);
  e.unregister_host(p);
};

/// True when executor E copies between its memory and the host's beside its launches:
/// `copy_async(dst, src, n)` (either way) enqueues the copy after everything enqueued on
/// the executor before it, returns a ticket (increasing, never 0) and does not wait;
/// `copy_wait(t)` waits for copy t and every copy before it. Until then nothing may read
/// `dst` (host code or a kernel), nor write `src`. ZeRO-Offload copies a tensor's grads
/// this way at grads_ready, so that backward's next kernels run meanwhile, and each bucket
/// of updated params while the host updates the next (cuda: a copy stream per device;
/// emulated_device: a queue that makes each copy only when it is waited for).
template <class E>
concept copies_async = requires(E& e, void* dst, const void* src, std::size_t n, std::uint64_t t) {
  { e.copy_async(dst, src, n) } -> std::same_as<std::uint64_t>;
  e.copy_wait(t);
};

/// True when executor E runs host functions: any callable passed to its parallel_for,
/// lambdas that capture host references included (cpu, kokkos on a host space,
/// emulated_device). False for an executor that declares `static constexpr bool
/// runs_host_functions = false` (cuda): it runs device code only, the trivially copyable
/// phases of distopt/engine/phases.hpp and the kernels of exec/cuda (GaLore's products and
/// SVD through its detail::matrix_ops), so the optimizer's parts that are still host loops
/// (Muon's Newton-Schulz) are refused on it at compile time.
template <class E>
inline constexpr bool runs_host_functions = true;
template <class E>
  requires requires { E::runs_host_functions; }
inline constexpr bool runs_host_functions<E> = E::runs_host_functions;

/// True for a communicator whose collectives take device memory (it declares `static
/// constexpr bool collectives_in_device_memory = true`: nccl); false for those of host
/// memory (single, threads, mpi, any_comm).
template <class C>
inline constexpr bool collectives_in_device_memory = false;
template <class C>
  requires requires { C::collectives_in_device_memory; }
inline constexpr bool collectives_in_device_memory<C> = C::collectives_in_device_memory;

/// An executor of type E with `threads` threads where E takes a thread count (cpu), else
/// E's default (kokkos: its space's own threads), for code generic over executors.
template <executor E>
E make_executor(int threads) {
  if constexpr (std::is_constructible_v<E, int>) return E(threads);
  else return E{};
}

namespace detail {
/// The checks of optimizer<Policy, Storage, Comm, Exec, Precision>'s arguments, each with
/// a message that names what is missing.
template <class Policy, class Storage, class Comm, class Exec, class Precision>
consteval bool check_optimizer_arguments() {
  static_assert(policy_declares_state<Policy>,
                "distopt::optimizer: the Policy must declare `static constexpr std::string_view "
                "name` and `static constexpr int max_state_slots` (0..4)");
  static_assert(policy_has_hyper_params<Policy>,
                "distopt::optimizer: the Policy needs a default-constructible `hyper_params` with "
                "`void validate() const` and `static int state_slots(const hyper_params&)`");
  static_assert(policy_prepares_scalars<Policy>,
                "distopt::optimizer: the Policy needs a trivially copyable `scalars` and `static "
                "scalars prepare(const hyper_params&, const step_info&)`");
  static_assert(policy_updates_elements<Policy> || policy_is_layerwise<Policy>,
                "distopt::optimizer: the Policy needs `DISTOPT_HD static void update(const "
                "scalars&, float& param, float grad, float* state)` taking param by non-const "
                "reference, or the phases of a layer-wise policy (see distopt/layerwise.hpp)");
  static_assert(!(policy_is_layerwise<Policy> && quantized_encoding<typename Storage::encoding>),
                "distopt::optimizer: 8-bit (q8) states are for element-wise policies (sgd, adam, "
                "adamw, lion, custom ones); the layer-wise policies keep fp32 or bf16 states");
  static_assert(state_storage<Storage>,
                "distopt::optimizer: Storage must model distopt::state_storage, e.g. "
                "distopt::replicated<distopt::fp32>");
  static_assert(communicator<Comm>, "distopt::optimizer: Comm must model distopt::communicator, e.g. distopt::single");
  static_assert(executor<Exec>, "distopt::optimizer: Exec must model distopt::executor, e.g. distopt::cpu");
  static_assert(number<typename Precision::param_type> && number<typename Precision::grad_type>,
                "distopt::optimizer: Precision must be distopt::precision<Param, Grad>");
  return true;
}
}  // namespace detail

}  // namespace distopt
