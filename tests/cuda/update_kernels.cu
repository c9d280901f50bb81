// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The CUDA update kernels against the CPU executor's loops, bit for bit (built with
// --fmad=false): for each (policy, slots, param mode, number types), pieces of awkward
// sizes at aligned and misaligned offsets in shared device buffers, 20 steps with a new
// gradient, scale and random key each step; and the same for 8-bit states (codes and
// absmax values compared), pieces of 1 to 4099 elements starting on quantization blocks. First the chunk cutting is checked on the
// host; then, without a CUDA device, the program exits 77 (ctest: skipped).

#include <distopt/distopt.hpp>
#include <distopt/detail/q8_loop.hpp>
#include <distopt/exec/cuda/q8_update.cuh>
#include <distopt/exec/cuda/update.cuh>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace distopt;
using distopt::detail::param_mode;
namespace ce = distopt::cuda_exec;

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

float value_at(std::uint64_t step, std::uint64_t i, float amplitude) {
  const std::uint64_t z = distopt::detail::splitmix64_finalise((step << 40) ^ i ^ 0x1234567ull);
  return (static_cast<float>(z >> 40) / static_cast<float>(1u << 24) * 2.0f - 1.0f) * amplitude;
}

// Piece sizes and where each starts in the shared buffers (element offsets): aligned
// starts, starts that share a misalignment (scalar head, vector body, scalar tail), and a
// piece whose grad is misaligned differently (scalar throughout).
struct placement {
  std::size_t count, offset, grad_offset;
};
const std::vector<placement> placements = {
    {1, 0, 0},          {3, 8, 8},           {257, 16, 16},      {561, 280, 280},
    {700, 843, 843},    {5000, 1547, 1549},  {100003, 6656, 6656}, {40000, 106664, 106664},
};
constexpr std::size_t buffer_elems = 150000;

template <class T>
struct mirrored {
  std::vector<T> host;
  T* device = nullptr;
  explicit mirrored(std::size_t n) : host(n) { ce::check(cudaMalloc(&device, n * sizeof(T)), "cudaMalloc"); }
  ~mirrored() { cudaFree(device); }
  void upload() { ce::check(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload"); }
  std::vector<T> download() const {
    std::vector<T> out(host.size());
    ce::check(cudaMemcpy(out.data(), device, out.size() * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return out;
  }
};

template <class T>
std::size_t differing(const std::vector<T>& a, const std::vector<T>& b) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return n;
}

template <class Policy, int N, param_mode Mode, class Param, class Grad, class Enc>
void check_case(const std::string& name, const typename Policy::hyper_params& h) {
  constexpr bool master = Mode == param_mode::master;
  mirrored<Param> p(buffer_elems);
  mirrored<Grad> g(buffer_elems);
  mirrored<float> m(buffer_elems);
  std::vector<mirrored<Enc>> st;
  st.reserve(N);
  for (int k = 0; k < N; ++k) st.emplace_back(buffer_elems);
  for (std::size_t i = 0; i < buffer_elems; ++i) {
    m.host[i] = value_at(0, i, 1.0f);
    p.host[i] = from_float<Param>(m.host[i]);
  }
  p.upload();
  m.upload();
  for (auto& s : st) s.upload();  // zeros

  std::vector<ce::piece<Param, Grad, Enc>> dev_pieces;
  std::vector<distopt::detail::update_args<Param, Grad, Enc>> host_args;
  for (const placement& pl : placements) {
    ce::piece<Param, Grad, Enc> d{p.device + pl.offset, g.device + pl.grad_offset, master ? m.device + pl.offset : nullptr,
                                  {}, pl.count, pl.offset * 3 + 11};
    distopt::detail::update_args<Param, Grad, Enc> a{p.host.data() + pl.offset, g.host.data() + pl.grad_offset,
                                                     master ? m.host.data() + pl.offset : nullptr, {}, 1.0f, 0,
                                                     pl.offset * 3 + 11};
    for (int k = 0; k < N; ++k) {
      d.state[k] = st[static_cast<std::size_t>(k)].device + pl.offset;
      a.state[k] = st[static_cast<std::size_t>(k)].host.data() + pl.offset;
    }
    dev_pieces.push_back(d);
    host_args.push_back(a);
  }
  // Small chunks, so that pieces take several and blocks several chunks each.
  const ce::update_plan<Param, Grad, Enc> plan(dev_pieces, N, master, 4096);
  expect(plan.vector_elements() > plan.elements() / 2, name + ": most elements in vector chunks");

  for (std::int64_t step = 1; step <= 20; ++step) {
    for (std::size_t i = 0; i < buffer_elems; ++i) g.host[i] = from_float<Grad>(value_at(static_cast<std::uint64_t>(step), i, 0.1f));
    g.upload();
    const auto sc = Policy::prepare(h, step_info{step, step == 1});
    const float scale = step % 3 == 0 ? 0.5f : 1.0f;
    const std::uint64_t key = distopt::detail::splitmix64_finalise(42 + static_cast<std::uint64_t>(step));
    plan.template run<Policy, N, Mode>(sc, scale, key);
    for (std::size_t k = 0; k < host_args.size(); ++k) {
      host_args[k].grad_scale = scale;
      host_args[k].random_key = key;
      distopt::detail::update_range<Policy, N, Mode>(sc, host_args[k], placements[k].count);
    }
  }
  ce::check(cudaDeviceSynchronize(), "update kernels");
  const std::size_t dp = differing(p.download(), p.host);
  expect(dp == 0, name + ": " + std::to_string(dp) + " params differ from the CPU's");
  if (master) {
    const std::size_t dm = differing(m.download(), m.host);
    expect(dm == 0, name + ": " + std::to_string(dm) + " master weights differ");
  }
  for (int k = 0; k < N; ++k) {
    const std::size_t ds = differing(st[static_cast<std::size_t>(k)].download(), st[static_cast<std::size_t>(k)].host);
    expect(ds == 0, name + ": " + std::to_string(ds) + " elements of state " + std::to_string(k) + " differ");
  }
  std::printf("%-40s %zu elements, %zu chunks, %.1f%% vectorised: %s\n", name.c_str(), plan.elements(),
              plan.chunks(), 100.0 * static_cast<double>(plan.vector_elements()) / static_cast<double>(plan.elements()),
              failures ? "see above" : "bit-identical to the CPU");
}

// 8-bit states: pieces start on quantization blocks of the code buffers; params and grads
// at odd offsets of theirs.
template <class Policy, int N, param_mode Mode, class Param, class Grad>
void check_q8_case(const std::string& name, const typename Policy::hyper_params& h) {
  constexpr bool master = Mode == param_mode::master;
  constexpr std::size_t B = distopt::q8::block;
  const std::vector<std::size_t> counts = {1, 255, 256, 257, 1000, 4099};
  std::size_t codes_total = 0;
  for (std::size_t c : counts) codes_total += (c + B - 1) / B * B;
  mirrored<Param> p(codes_total + 64);
  mirrored<Grad> g(codes_total + 64);
  mirrored<float> m(codes_total + 64);
  std::vector<mirrored<std::uint8_t>> codes;
  std::vector<mirrored<float>> absmax;
  codes.reserve(N);
  absmax.reserve(N);
  for (int k = 0; k < N; ++k) {
    codes.emplace_back(codes_total);
    absmax.emplace_back(codes_total / B);
  }
  for (std::size_t i = 0; i < p.host.size(); ++i) {
    m.host[i] = value_at(0, i, 1.0f);
    p.host[i] = from_float<Param>(m.host[i]);
  }
  p.upload();
  m.upload();
  for (int k = 0; k < N; ++k) {
    codes[static_cast<std::size_t>(k)].upload();
    absmax[static_cast<std::size_t>(k)].upload();
  }
  std::vector<const distopt::detail::q8_codebook*> books;
  for (int k = 0; k < N; ++k)
    books.push_back(distopt::state_slot_nonnegative<Policy>(k) ? &distopt::detail::unsigned_codebook()
                                                              : &distopt::detail::signed_codebook());
  std::vector<ce::q8_piece<Param, Grad>> dev_pieces;
  std::vector<distopt::detail::q8_args<Param, Grad>> host_args;
  std::size_t code_offset = 0, offset = 3;
  for (std::size_t c : counts) {
    ce::q8_piece<Param, Grad> d{p.device + offset, g.device + offset, master ? m.device + offset : nullptr, {}, {},
                                c, offset * 5 + 1};
    distopt::detail::q8_args<Param, Grad> a{p.host.data() + offset, g.host.data() + offset,
                                            master ? m.host.data() + offset : nullptr, {}, {}, {}, {}, 1.0f, 0,
                                            offset * 5 + 1};
    for (int k = 0; k < N; ++k) {
      const auto ks = static_cast<std::size_t>(k);
      d.code[k] = codes[ks].device + code_offset;
      d.absmax[k] = absmax[ks].device + code_offset / B;
      a.code[k] = codes[ks].host.data() + code_offset;
      a.absmax[k] = absmax[ks].host.data() + code_offset / B;
      a.map[k] = books[ks]->values().data();
      a.lut[k] = books[ks]->lookup();
    }
    dev_pieces.push_back(d);
    host_args.push_back(a);
    code_offset += (c + B - 1) / B * B;
    offset += c + 7;
  }
  const ce::q8_update_plan<Param, Grad> plan(dev_pieces, books);
  for (std::int64_t step = 1; step <= 20; ++step) {
    for (std::size_t i = 0; i < g.host.size(); ++i)
      g.host[i] = from_float<Grad>(value_at(static_cast<std::uint64_t>(step), i, 0.1f));
    g.upload();
    const auto sc = Policy::prepare(h, step_info{step, step == 1});
    const float scale = step % 3 == 0 ? 0.5f : 1.0f;
    const std::uint64_t key = distopt::detail::splitmix64_finalise(7 + static_cast<std::uint64_t>(step));
    plan.template run<Policy, N, Mode>(sc, scale, key);
    for (std::size_t k = 0; k < host_args.size(); ++k) {
      host_args[k].grad_scale = scale;
      host_args[k].random_key = key;
      distopt::detail::update_range_q8<Policy, N, Mode>(sc, host_args[k], counts[k]);
    }
  }
  ce::check(cudaDeviceSynchronize(), "q8 update kernels");
  const std::size_t dp = differing(p.download(), p.host);
  expect(dp == 0, name + ": " + std::to_string(dp) + " params differ from the CPU's");
  if (master) expect(differing(m.download(), m.host) == 0, name + ": master weights differ");
  for (int k = 0; k < N; ++k) {
    const auto ks = static_cast<std::size_t>(k);
    const std::size_t dc = differing(codes[ks].download(), codes[ks].host);
    const std::size_t da = differing(absmax[ks].download(), absmax[ks].host);
    expect(dc == 0 && da == 0, name + ": slot " + std::to_string(k) + ": " + std::to_string(dc) + " codes and " +
                                   std::to_string(da) + " absmax values differ");
  }
  std::printf("%-40s %zu quantization blocks: %s\n", name.c_str(), plan.blocks(),
              failures ? "see above" : "bit-identical to the CPU");
}

// Chunk cutting on the host (pointer arithmetic only; no device needed).
void check_chunks() {
  alignas(16) static float buf[4096];
  alignas(16) static bf16 half[4096];
  using P = ce::piece<bf16, float, float>;
  // 0: aligned; 1: aligned 16 bytes in; 2: the arrays never reach a 16-byte boundary at
  // the same element (scalar); 3: all 8 bytes (bf16) / 16 bytes (float) short of one at
  // element 4 (scalar head of 4, then vectors); 4: too short to reach one.
  std::vector<P> pieces{{half, buf, nullptr, {buf + 2048}, 1000, 0},
                        {half + 8, buf + 4, nullptr, {buf + 2052}, 100, 0},
                        {half + 1, buf + 2, nullptr, {buf + 2050}, 50, 0},
                        {half + 4, buf + 512, nullptr, {buf + 2560}, 100, 0},
                        {half + 5, buf + 5, nullptr, {buf + 2053}, 3, 0}};
  const auto c = ce::cut_chunks(pieces, 1, false, 256);
  std::size_t covered[5] = {}, vectorised[5] = {};
  for (const auto& ch : c) {
    covered[ch.piece] += ch.count;
    expect(ch.count <= 256, "chunks at most chunk_elems long");
    if (!ch.vector) continue;
    vectorised[ch.piece] += ch.count;
    expect(ch.count % ce::vector_width == 0, "vector chunks a multiple of the width");
    const auto& pc = pieces[ch.piece];
    expect(reinterpret_cast<std::uintptr_t>(pc.param + ch.offset) % 16 == 0 &&
               reinterpret_cast<std::uintptr_t>(pc.grad + ch.offset) % 16 == 0 &&
               reinterpret_cast<std::uintptr_t>(pc.state[0] + ch.offset) % 16 == 0,
           "vector chunks aligned");
  }
  for (int k = 0; k < 5; ++k) expect(covered[k] == pieces[static_cast<std::size_t>(k)].count, "every element in one chunk");
  expect(vectorised[0] == 1000, "an aligned piece is vectorised");
  expect(vectorised[1] == 96, "an aligned piece is vectorised but for its tail");
  expect(vectorised[2] == 0, "a piece whose arrays never align together stays scalar");
  expect(vectorised[3] == 96, "a scalar head of 4 elements, then vectors");
  expect(vectorised[4] == 0, "a piece too short to align stays scalar");
  bool refused = false;
  try {
    ce::cut_chunks(pieces, 1, false, 100);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  expect(refused, "chunk_elems not a multiple of the vector width is refused");
}

}  // namespace

int main() {
  check_chunks();
  if (failures) return 1;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("host checks passed; no CUDA device: the kernel comparison is skipped\n");
    return 77;
  }
  sgd::hyper_params momentum;
  momentum.lr = 0.05;
  momentum.momentum = 0.9;
  momentum.weight_decay = 0.01;
  sgd::hyper_params nesterov = momentum;
  nesterov.nesterov = true;
  adamw::hyper_params w;
  w.lr = 1e-2;
  adam::hyper_params ams;
  ams.amsgrad = true;
  ams.weight_decay = 0.1;
  lion::hyper_params li;
  li.lr = 1e-3;
  li.weight_decay = 0.1;
  check_case<sgd, 1, param_mode::fp32, float, float, float>("sgd momentum fp32", momentum);
  check_case<sgd, 1, param_mode::no_master_rne, bf16, bf16, bf16>("sgd nesterov bf16 (no master, RNE)", nesterov);
  check_case<adamw, 2, param_mode::fp32, float, float, float>("adamw fp32", w);
  check_case<adamw, 2, param_mode::fp32, float, float, bf16>("adamw fp32, bf16 states", w);
  check_case<adamw, 2, param_mode::master, bf16, bf16, float>("adamw bf16 + fp32 master", w);
  check_case<adam, 3, param_mode::master, fp16, fp16, float>("adam amsgrad fp16 + master", ams);
  check_case<lion, 1, param_mode::fp32, float, float, float>("lion fp32", li);
  check_case<lion, 1, param_mode::no_master_sr, bf16, float, float>("lion bf16 stochastic rounding", li);
  check_q8_case<adamw, 2, param_mode::fp32, float, float>("q8 adamw fp32", w);
  check_q8_case<adamw, 2, param_mode::master, bf16, bf16>("q8 adamw bf16 + fp32 master", w);
  check_q8_case<sgd, 1, param_mode::fp32, float, float>("q8 sgd momentum", momentum);
  check_q8_case<lion, 1, param_mode::no_master_sr, bf16, float>("q8 lion bf16 stochastic rounding", li);
  std::printf("%s\n", failures ? "FAILED" : "all cases bit-identical to the CPU executor");
  return failures ? 1 : 0;
}
