// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-checkpoint: throughput of `opt.save(dir)` and `opt.load(dir)` against the
// disk's sequential write (write() + fsync) and read speed, measured in the same run on the
// same file system with the same number of bytes.
//
//   distopt-bench-checkpoint [--params N] [--ranks 1,2] [--precision fp32|bf16|both]
//                            [--dir PATH] [--repeats R] [--settle S] [--breakdown on|off]
//                            [--json FILE] [--label L] [--tp-reshard SAVE:LOAD,LOAD...]
//
// --tp-reshard (only that) saves on a TP grid of size SAVE and times warm loads on each
// TP size LOAD: the cost of resharding over TP against the same-TP load (tp_loads).
//
// Workload: AdamW with sharded<fp32> states over the GPT-like tensors of distopt-bench-step
// (bench::gpt_like), d ranks as threads of this process (distopt::run_ranks), one executor
// thread per rank, trained one step (so the states and master weights are written) and
// saved once untimed (warm-up), then R repeats of: disk write tests, a pause, save, warm
// load (the files still in the page cache, as right after the save), disk read test, cold
// load (every file of the checkpoint evicted from the page cache with
// posix_fadvise(DONTNEED) first; mincore checks that they were). Each save writes a new
// generation and removes the previous one, as in training. Bytes: the sum of the sizes of
// the files the save leaves (rank files and index.json). fp32: param + 2 states =
// 12 B/param; bf16 params with fp32 master weights: 2 + 4 + 8 = 14 B/param (plus headers).
//
// Roofline, with the checkpoint's bytes, each repeat next to the save or load it is
// compared with (rank 0, the other ranks waiting): a new generation of one file written
// from memory with write() in 16 MiB calls and fsynced while the previous generation is
// still there, then the previous one unlinked (the save's own sequence, "disk W"), and the
// file read cold with read() in 16 MiB calls ("disk R"); with d > 1 also d files written
// and read by d threads at once. Disk W and the save both start S seconds after memory
// was last freed (settings::settle_s says why); "W hot" is write() + fsync right after
// memory was freed, the best case. Ratio = save GB/s / disk write GB/s and cold load GB/s
// / disk read GB/s (best of R each), and the median over repeats of each repeat's pair.
// The breakdown (d = 1 only) replays what save and load do, step by step, on the same
// optimizer's checkpoint items: chunk checksums, page-cache copy (write()), fsync, rename,
// unlink; staging allocation, cold pread, checksums, staging and install copies.
//
// Files go to DIR/distopt-bench-checkpoint-PID (DIR: --dir, default /tmp), removed at the
// end. Prints a table, then one JSON line per case (also appended to FILE).

#include <distopt/checkpoint.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "step_bench.hpp"

namespace fs = std::filesystem;

namespace {

struct settings {
  std::size_t params = std::size_t{64} << 20;
  std::vector<int> ranks{1, 2};
  std::string precision = "both";
  std::string dir = "/tmp";
  int repeats = 3;
  bool breakdown = true;
  /// Seconds between freeing memory and the next fresh write (disk test or save). The
  /// development VM hands free guest memory back to its host from about 2 s after it was
  /// freed (virtio-balloon free page reporting), and each page-cache page taken from such
  /// memory costs a host fault (write() then runs at ~0.35 GB/s instead of ~4): a save,
  /// which writes the new generation before it removes the previous one, minutes after
  /// the last, meets that state; a write right after memory was freed reuses hot pages.
  double settle_s = 4;
  std::string json_path;
  std::string label;
  /// --tp-reshard SAVE:LOAD,LOAD...: only the TP resharding loads (see tp_loads).
  int save_tp = 0;
  std::vector<int> load_tps;
};

constexpr std::size_t io_call = std::size_t{16} << 20;  // bytes per write()/read() of the disk test

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
double gbps(double bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0.0; }
double best(const std::vector<double>& v) { return v.empty() ? 0 : *std::min_element(v.begin(), v.end()); }
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

[[noreturn]] void fail_errno(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

std::vector<fs::path> regular_files(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

/// Drops the file's pages from the page cache (written back first if dirty).
void evict(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno("cannot open " + p.string());
  (void)::fdatasync(fd);
  const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (rc != 0) {
    errno = rc;
    fail_errno("posix_fadvise " + p.string());
  }
}

/// Pages of the file in the page cache, and its pages in all (mincore).
std::pair<std::size_t, std::size_t> resident_pages(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno("cannot open " + p.string());
  struct stat st {};
  (void)::fstat(fd, &st);
  const std::size_t size = static_cast<std::size_t>(st.st_size), page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  if (size == 0) {
    ::close(fd);
    return {0, 0};
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) fail_errno("mmap " + p.string());
  std::vector<unsigned char> v((size + page - 1) / page);
  const int rc = ::mincore(m, size, v.data());
  ::munmap(m, size);
  if (rc != 0) fail_errno("mincore " + p.string());
  std::size_t in = 0;
  for (unsigned char c : v) in += c & 1u;
  return {in, v.size()};
}

/// Evicts every regular file of `dir`; returns the fraction of their pages still cached.
double evict_dir(const fs::path& dir) {
  std::size_t in = 0, all = 0;
  for (const auto& p : regular_files(dir)) evict(p);
  for (const auto& p : regular_files(dir)) {
    const auto [i, a] = resident_pages(p);
    in += i;
    all += a;
  }
  return all ? static_cast<double>(in) / static_cast<double>(all) : 0.0;
}

std::uint64_t dir_bytes(const fs::path& dir, int* files = nullptr) {
  std::uint64_t b = 0;
  int n = 0;
  for (const auto& p : regular_files(dir)) {
    b += fs::file_size(p);
    ++n;
  }
  if (files) *files = n;
  return b;
}

bool write_all(int fd, const std::byte* data, std::size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, std::min(size, io_call));
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

bool read_all(int fd, std::byte* out, std::size_t size) {
  while (size > 0) {
    const ssize_t n = ::read(fd, out, std::min(size, io_call));
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (n == 0) return false;
    out += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

/// The disk's sequential speeds for `bytes` split over `streams` files written (and then
/// read cold) by as many threads at once, each taken next to the save or the cold load it
/// is compared with. Two kinds of write (`settings::settle_s` says why they differ here):
/// "fresh" does what a save does to the file system and the page cache: a new generation
/// of files written and fsynced while the previous one is still there, then the previous
/// one unlinked (all timed), started `settle` seconds after the last memory was freed, as
/// the save is; "hot" writes files right after memory was freed (the page cache reuses
/// those pages) and removes them untimed: the best case of write() + fsync. Each write split
/// into write() (into the page cache), fsync and unlink, from its best repeat.
struct disk_result {
  int streams = 1;
  std::uint64_t bytes = 0;
  std::vector<double> write_s, write_hot_s, read_s;
  double write_call_s = 0, fsync_s = 0, unlink_s = 0;  ///< of the best fresh write (the slowest stream)
  double hot_write_call_s = 0, hot_fsync_s = 0;        ///< of the best hot write
  double resident = 0;                                 ///< after eviction, before the reads (max)
};

class disk_test {
public:
  disk_test(fs::path dir, std::uint64_t bytes) : dir_(std::move(dir)), bytes_(bytes), data_(bytes), back_(bytes) {
    std::uint64_t x = 0x9e3779b97f4a7c15ull;  // xorshift: bytes a disk cannot compress or dedupe
    for (std::size_t i = 0; i + 8 <= data_.size(); i += 8) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::memcpy(data_.data() + i, &x, 8);
    }
  }
  ~disk_test() {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir_, ec))
      if (e.path().filename().string().starts_with("disk-test-")) fs::remove(e.path(), ec);
  }

  /// A fresh write (`hot` false): generation g + 1 of the `streams` files written and
  /// fsynced, then generation g unlinked; or a hot one: files written, fsynced, then
  /// removed untimed.
  void write(disk_result& r, bool hot) {
    r.bytes = bytes_;
    const int streams = r.streams;
    int& gen = generation_[streams];
    const std::string tag = hot ? "hot" : std::to_string(gen + 1);
    std::vector<double> t_write(streams), t_fsync(streams);
    std::vector<std::string> errors(streams);
    const double t0 = now_s();
    run(streams, [&](int k, std::size_t offset, std::size_t n) {
      const fs::path p = path(streams, tag, k);
      const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd < 0) {
        errors[k] = "cannot create " + p.string() + ": " + std::strerror(errno);
        return;
      }
      if (!write_all(fd, data_.data() + offset, n)) errors[k] = "write failed";
      t_write[k] = now_s();
      if (::fsync(fd) != 0) errors[k] = "fsync failed";
      t_fsync[k] = now_s();
      ::close(fd);
    });
    const double t1 = now_s();
    for (const auto& e : errors)
      if (!e.empty()) throw std::runtime_error("disk test: " + e);
    if (!hot && gen > 0)
      for (int k = 0; k < streams; ++k) fs::remove(path(streams, std::to_string(gen), k));
    const double t2 = now_s();
    if (hot)
      for (int k = 0; k < streams; ++k) fs::remove(path(streams, tag, k));
    else
      ++gen;
    auto& times = hot ? r.write_hot_s : r.write_s;
    const double total = hot ? t1 - t0 : t2 - t0;
    if (times.empty() || total < best(times)) {
      const double w = *std::max_element(t_write.begin(), t_write.end());
      (hot ? r.hot_write_call_s : r.write_call_s) = w - t0;
      (hot ? r.hot_fsync_s : r.fsync_s) = t1 - w;
      if (!hot) r.unlink_s = t2 - t1;
    }
    times.push_back(total);
  }

  /// One cold read of the files the last fresh write() left.
  void read(disk_result& r) {
    const int streams = r.streams;
    const std::string tag = std::to_string(generation_[streams]);
    double res = 0;
    for (int k = 0; k < streams; ++k) {
      evict(path(streams, tag, k));
      const auto [in, all] = resident_pages(path(streams, tag, k));
      res = std::max(res, all ? static_cast<double>(in) / static_cast<double>(all) : 0.0);
    }
    r.resident = std::max(r.resident, res);
    std::vector<std::string> errors(streams);
    const double t0 = now_s();
    run(streams, [&](int k, std::size_t offset, std::size_t n) {
      const int fd = ::open(path(streams, tag, k).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0 || !read_all(fd, back_.data() + offset, n)) errors[k] = "read failed";
      if (fd >= 0) ::close(fd);
    });
    r.read_s.push_back(now_s() - t0);
    for (const auto& e : errors)
      if (!e.empty()) throw std::runtime_error("disk test: " + e);
    if (std::memcmp(back_.data(), data_.data(), data_.size()) != 0)
      throw std::runtime_error("disk test: read back other bytes than written");
  }

private:
  fs::path path(int streams, const std::string& tag, int k) const {
    return dir_ / ("disk-test-" + std::to_string(streams) + "-" + tag + "-" + std::to_string(k) + ".bin");
  }

  template <class F>
  void run(int streams, F&& f) {
    const std::size_t part = static_cast<std::size_t>((bytes_ + streams - 1) / streams);
    std::vector<std::thread> workers;
    for (int k = 0; k < streams; ++k) {
      const std::size_t offset = static_cast<std::size_t>(k) * part;
      const std::size_t n = std::min<std::size_t>(part, static_cast<std::size_t>(bytes_) - offset);
      workers.emplace_back([&f, k, offset, n] { f(k, offset, n); });
    }
    for (auto& w : workers) w.join();
  }

  fs::path dir_;
  std::uint64_t bytes_;
  std::vector<std::byte> data_, back_;
  std::map<int, int> generation_;  ///< per stream count: the last fresh generation written
};

/// The steps of save and load replayed on one rank's checkpoint items (d = 1).
struct breakdown {
  double hash_s = 0, header_s = 0, write_s = 0, fsync_s = 0, rename_s = 0, unlink_s = 0;  // save
  double stage_alloc_s = 0, read_s = 0, check_s = 0, stage_copy_s = 0, install_s = 0;     // load
  double read_resident = 0;
};

/// The optimizer with the items its checkpoint writes in reach (its context is protected).
template <class Optimizer>
struct itemized : Optimizer {
  using Optimizer::Optimizer;
  auto checkpoint_items() { return distopt::io::checkpoint_access::party(this->ctx_, this->stages_).items(); }
};

template <class Opt>
breakdown replay(Opt& opt, const fs::path& dir, double settle_s) {
  namespace io = distopt::io;
  breakdown b;
  auto items = opt.checkpoint_items();
  // Save: checksums, header, write() into a temporary file, fsync, rename (and directory
  // fsync), then the unlink that removes the previous generation.
  double t = now_s();
  std::vector<std::vector<std::uint64_t>> hashes(items.size());
  for (std::size_t k = 0; k < items.size(); ++k)
    if (items[k].save)
      hashes[k] = io::detail::chunk_hashes(items[k].source, items[k].first, items[k].count, items[k].element_size);
  b.hash_s = now_s() - t;
  t = now_s();
  io::safetensors_writer w;
  std::vector<std::span<const std::byte>> views;
  for (const auto& it : items) {
    if (!it.save) continue;
    w.add_view(it.name, it.dtype, {static_cast<std::int64_t>(it.count)},
               std::span<const std::byte>(it.source, it.count * it.element_size));
  }
  w.set_metadata("distopt.items", io::detail::items_text(items, hashes));
  const std::string head = w.header();
  b.header_s = now_s() - t;
  const fs::path tmp = dir / ".replay.tmp", final_path = dir / "replay.safetensors";
  std::this_thread::sleep_for(std::chrono::duration<double>(settle_s));  // as before each save
  t = now_s();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail_errno("cannot create " + tmp.string());
  bool ok = io::detail::write_all(fd, reinterpret_cast<const std::byte*>(head.data()), head.size());
  std::vector<std::uint64_t> offsets;  // of each saved item's bytes in the file
  std::uint64_t at = head.size();
  for (const auto& it : items) {
    if (!it.save) {
      offsets.push_back(0);
      continue;
    }
    offsets.push_back(at);
    ok = ok && io::detail::write_all(fd, it.source, it.count * it.element_size);
    at += it.count * it.element_size;
  }
  if (!ok) fail_errno("cannot write " + tmp.string());
  b.write_s = now_s() - t;
  t = now_s();
  if (::fsync(fd) != 0) fail_errno("cannot fsync " + tmp.string());
  b.fsync_s = now_s() - t;
  t = now_s();
  ::close(fd);
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) fail_errno("cannot rename " + tmp.string());
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  b.rename_s = now_s() - t;

  // Load, as load_checkpoint reads one rank's slices: staging allocated (zeroed) per item,
  // each slice pread cold into a reused buffer, its chunks checked, copied into staging,
  // then installed (memcpy into the optimizer's buffers; the same bytes).
  evict(final_path);
  const auto [in, all] = resident_pages(final_path);
  b.read_resident = all ? static_cast<double>(in) / static_cast<double>(all) : 0.0;
  const int rfd = ::open(final_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (rfd < 0) fail_errno("cannot open " + final_path.string());
  std::vector<std::vector<std::byte>> staged(items.size());
  std::vector<std::byte> buffer;
  for (std::size_t k = 0; k < items.size(); ++k) {
    const auto& it = items[k];
    if (!it.save) continue;
    const std::size_t n = static_cast<std::size_t>(it.count * it.element_size);
    double t0 = now_s();
    staged[k].resize(n);
    double t1 = now_s();
    b.stage_alloc_s += t1 - t0;
    buffer.resize(n);
    if (!io::detail::read_at(rfd, buffer.data(), n, offsets[k])) fail_errno("cannot read " + final_path.string());
    t0 = now_s();
    b.read_s += t0 - t1;
    const auto h = io::detail::chunk_hashes(buffer.data(), it.first, it.count, it.element_size);
    if (h != hashes[k]) throw std::runtime_error("replay: checksum mismatch");
    t1 = now_s();
    b.check_s += t1 - t0;
    std::memcpy(staged[k].data(), buffer.data(), n);
    t0 = now_s();
    b.stage_copy_s += t0 - t1;
  }
  ::close(rfd);
  t = now_s();
  for (std::size_t k = 0; k < items.size(); ++k)
    if (items[k].save) items[k].install(staged[k]);
  b.install_s = now_s() - t;
  staged.clear();
  t = now_s();
  fs::remove(final_path);
  b.unlink_s = now_s() - t;
  return b;
}

/// One (precision, d) case.
struct result {
  std::string param;
  int ranks = 1;
  std::size_t params = 0;
  std::uint64_t bytes = 0;
  int files = 0;
  std::vector<double> save_s, load_warm_s, load_cold_s;
  double cold_resident = 0;  ///< the most of the checkpoint's pages still cached before a cold load
  disk_result disk1, diskd;  ///< one stream; d streams (d > 1)
  bool has_breakdown = false;
  breakdown bd;

  double bpp() const { return static_cast<double>(bytes) / static_cast<double>(params); }
  double save_gbps() const { return gbps(static_cast<double>(bytes), best(save_s)); }
  double cold_gbps() const { return gbps(static_cast<double>(bytes), best(load_cold_s)); }
  double warm_gbps() const { return gbps(static_cast<double>(bytes), best(load_warm_s)); }
  double disk_write_gbps() const { return gbps(static_cast<double>(disk1.bytes), best(disk1.write_s)); }
  double disk_write_hot_gbps() const { return gbps(static_cast<double>(disk1.bytes), best(disk1.write_hot_s)); }
  double disk_read_gbps() const { return gbps(static_cast<double>(disk1.bytes), best(disk1.read_s)); }
  /// The median over repeats of each pair's ratio (the disk test and the save or cold load
  /// of the same repeat, taken one after the other).
  static double pair_ratio(const std::vector<double>& disk_s, const std::vector<double>& s) {
    std::vector<double> v;
    for (std::size_t i = 0; i < std::min(disk_s.size(), s.size()); ++i) v.push_back(disk_s[i] / s[i]);
    return median(v);
  }
  double save_ratio_median() const { return pair_ratio(disk1.write_s, save_s); }
  double cold_ratio_median() const { return pair_ratio(disk1.read_s, load_cold_s); }
};

/// Builds the optimizer on d ranks, takes one step, saves once untimed (warm-up; it sizes
/// the disk test), then R repeats of: disk write tests (rank 0, the others waiting; hot,
/// then fresh), a pause of `settle` seconds, save, warm load, disk read test, cold load;
/// then (d = 1) the replay.
template <class Param>
result measure(const settings& s, const fs::path& dir, int d) {
  using opt_t = itemized<distopt::optimizer<distopt::adamw, distopt::sharded<distopt::fp32>, distopt::threads,
                                            distopt::cpu, distopt::precision<Param, Param>>>;
  result out;
  out.param = std::is_same_v<Param, float> ? "fp32" : "bf16+master";
  out.ranks = d;
  const fs::path ckpt = dir / "ckpt";
  const auto progress = [&](const char* what, int rep, double dt) {
    char n[32] = "";
    if (rep >= 0) std::snprintf(n, sizeof n, " %d/%d", rep + 1, s.repeats);
    std::printf("# %s d=%d %s%s: %.3f s, %.3f GB/s\n", out.param.c_str(), d, what, n, dt,
                gbps(static_cast<double>(out.bytes), dt));
    std::fflush(stdout);
  };
  distopt::run_ranks(
      d,
      [&](distopt::threads& comm) {
        distopt::optimizer_options o;
        o.master_weights = true;
        const int rank = comm.rank();
        opt_t opt(bench::gpt_like(s.params, distopt::dtype_of<Param>), distopt::adamw::hyper_params{}, o,
                  distopt::cpu(1), std::move(comm));
        auto& c = opt.communicator();
        const auto max_all = [&](double x) {
          std::array<double, 1> v{x};
          c.all_reduce(std::span<double>(v), distopt::reduce_op::max);
          return v[0];
        };
        if (rank == 0) out.params = opt.tensors().numel();
        // Values that differ element by element.
        auto p = opt.params();
        for (std::size_t i = 0; i < p.size(); ++i)
          p[i] = distopt::from_float<Param>(static_cast<float>((i * 2654435761u) % 1000003) * 1e-7f - 0.05f);
        auto g = opt.grads();
        for (std::size_t i = 0; i < g.size(); ++i)
          g[i] = distopt::from_float<Param>(static_cast<float>((i * 40503u + static_cast<std::size_t>(rank)) % 65521) *
                                            1e-8f);
        opt.step();  // states and master weights started

        max_all(0);
        double t0 = now_s();
        opt.save(ckpt);
        double dt = max_all(now_s() - t0);
        std::optional<disk_test> disk;
        if (rank == 0) {
          out.bytes = dir_bytes(ckpt, &out.files);
          progress("save (warm-up, first in the directory)", -1, dt);
          disk.emplace(dir, out.bytes);
          out.diskd.streams = d;
          for (int streams : {1, d}) {  // a first generation, so that every timed write unlinks one
            disk_result first;
            first.streams = streams;
            disk->write(first, false);
          }
        }
        const auto disk_note = [&](const char* what, const std::vector<double>& v) {
          std::printf("# %s d=%d disk %s %zu/%d: %.3f s, %.3f GB/s\n", out.param.c_str(), d, what, v.size(),
                      s.repeats, v.back(), gbps(static_cast<double>(out.bytes), v.back()));
          std::fflush(stdout);
        };

        for (int rep = 0; rep < s.repeats; ++rep) {
          if (rank == 0) {
            const auto settle = [&] { std::this_thread::sleep_for(std::chrono::duration<double>(s.settle_s)); };
            disk->write(out.disk1, true);  // right after the last cold load freed its staging
            disk_note("write hot (1 stream)", out.disk1.write_hot_s);
            settle();
            disk->write(out.disk1, false);
            disk_note("write fresh (1 stream)", out.disk1.write_s);
            if (d > 1) {
              settle();
              disk->write(out.diskd, false);
              disk_note("write fresh (d streams)", out.diskd.write_s);
            }
            settle();
          }
          max_all(0);
          t0 = now_s();
          opt.save(ckpt);
          dt = max_all(now_s() - t0);
          if (rank == 0) {
            out.save_s.push_back(dt);
            if (dir_bytes(ckpt) != out.bytes) throw std::runtime_error("a save wrote another number of bytes");
            progress("save", rep, dt);
          }
          max_all(0);  // warm: the pages the save left in the cache
          t0 = now_s();
          opt.load(ckpt);
          dt = max_all(now_s() - t0);
          if (rank == 0) {
            out.load_warm_s.push_back(dt);
            progress("load warm", rep, dt);
          }
          if (rank == 0) {
            disk->read(out.disk1);
            disk_note("read (1 stream)", out.disk1.read_s);
            if (d > 1) {
              disk->read(out.diskd);
              disk_note("read (d streams)", out.diskd.read_s);
            }
          }
          if (rank == 0) out.cold_resident = std::max(out.cold_resident, evict_dir(ckpt));
          max_all(0);
          t0 = now_s();
          opt.load(ckpt);
          dt = max_all(now_s() - t0);
          if (rank == 0) {
            out.load_cold_s.push_back(dt);
            progress("load cold", rep, dt);
          }
        }
        disk.reset();
        if (d == 1 && s.breakdown) {
          out.bd = replay(opt, dir, s.settle_s);
          out.has_breakdown = true;
        }
        max_all(0);
      },
      std::chrono::minutes(10));
  fs::remove_all(ckpt);
  return out;
}

void print_header() {
  std::printf("\n%-12s %2s %7s %11s %5s | %7s %6s %6s %5s %5s %6s %5s | %7s %6s %6s %5s %5s | %7s %6s | %6s %6s\n",
              "param", "d", "B/param", "bytes", "files", "save s", "GB/s", "disk W", "ratio", "med", "W hot", "ratio",
              "cold s", "GB/s", "disk R", "ratio", "med", "warm s", "GB/s", "W d-st", "R d-st");
}

void print_row(const result& r) {
  char dw[16] = "-", dr[16] = "-";
  if (r.ranks > 1) {
    std::snprintf(dw, sizeof dw, "%.3f", gbps(static_cast<double>(r.diskd.bytes), best(r.diskd.write_s)));
    std::snprintf(dr, sizeof dr, "%.3f", gbps(static_cast<double>(r.diskd.bytes), best(r.diskd.read_s)));
  }
  std::printf(
      "%-12s %2d %7.3f %11llu %5d | %7.3f %6.3f %6.3f %5.2f %5.2f %6.3f %5.2f | %7.3f %6.3f %6.3f %5.2f %5.2f | %7.3f "
      "%6.3f | %6s %6s\n",
      r.param.c_str(), r.ranks, r.bpp(), static_cast<unsigned long long>(r.bytes), r.files, best(r.save_s),
      r.save_gbps(), r.disk_write_gbps(), r.save_gbps() / r.disk_write_gbps(), r.save_ratio_median(),
      r.disk_write_hot_gbps(), r.save_gbps() / r.disk_write_hot_gbps(), best(r.load_cold_s), r.cold_gbps(),
      r.disk_read_gbps(), r.cold_gbps() / r.disk_read_gbps(), r.cold_ratio_median(), best(r.load_warm_s),
      r.warm_gbps(), dw, dr);
}

void print_breakdown(const result& r) {
  if (!r.has_breakdown) return;
  const breakdown& b = r.bd;
  const double B = static_cast<double>(r.bytes);
  const double save_sum = b.hash_s + b.header_s + b.write_s + b.fsync_s + b.rename_s + b.unlink_s;
  const double load_sum = b.stage_alloc_s + b.read_s + b.check_s + b.stage_copy_s + b.install_s;
  std::printf("\n%s d=1, save replayed (s, GB/s of the checkpoint's bytes): checksums %.3f (%.1f), header %.3f, "
              "write() %.3f (%.2f), fsync %.3f (%.2f), close+rename+dir fsync %.3f, unlink %.3f; sum %.3f "
              "(save best %.3f); disk test fresh: write() %.3f + fsync %.3f + unlink %.3f; hot: write() %.3f + fsync "
              "%.3f\n",
              r.param.c_str(), b.hash_s, gbps(B, b.hash_s), b.header_s, b.write_s, gbps(B, b.write_s), b.fsync_s,
              gbps(B, b.fsync_s), b.rename_s, b.unlink_s, save_sum, best(r.save_s), r.disk1.write_call_s,
              r.disk1.fsync_s, r.disk1.unlink_s, r.disk1.hot_write_call_s, r.disk1.hot_fsync_s);
  std::printf("%s d=1, load replayed: staging alloc %.3f, pread cold %.3f (%.2f GB/s; %.1f %% cached before), "
              "checksums %.3f (%.1f), staging copy %.3f (%.1f), install %.3f (%.1f); sum %.3f (cold load best %.3f, "
              "warm %.3f)\n",
              r.param.c_str(), b.stage_alloc_s, b.read_s, gbps(B, b.read_s), 100 * b.read_resident, b.check_s,
              gbps(B, b.check_s), b.stage_copy_s, gbps(B, b.stage_copy_s), b.install_s, gbps(B, b.install_s), load_sum,
              best(r.load_cold_s), best(r.load_warm_s));
}

std::string json(const result& r, const settings& s, int cores) {
  auto list = [](const std::vector<double>& v) {
    std::string out = "[";
    for (std::size_t i = 0; i < v.size(); ++i) {
      char b[32];
      std::snprintf(b, sizeof b, "%s%.4f", i ? "," : "", v[i]);
      out += b;
    }
    return out + "]";
  };
  char buf[3072];
  std::snprintf(
      buf, sizeof buf,
      "{\"bench\":\"checkpoint\",\"label\":\"%s\",\"policy\":\"adamw\",\"storage\":\"sharded<fp32>\",\"param\":\"%s\","
      "\"ranks\":%d,\"cores\":%d,\"params\":%zu,\"bytes\":%llu,\"files\":%d,\"bytes_per_param\":%.4f,\"repeats\":%d,"
      "\"save_s\":%s,\"save_gbps\":%.4f,\"disk_write_gbps\":%.4f,\"save_ratio\":%.4f,"
      "\"load_cold_s\":%s,\"load_cold_gbps\":%.4f,\"disk_read_gbps\":%.4f,\"load_cold_ratio\":%.4f,"
      "\"cold_resident\":%.4f,\"disk_read_resident\":%.4f,\"load_warm_s\":%s,\"load_warm_gbps\":%.4f,"
      "\"disk_write_s\":%s,\"disk_read_s\":%s,\"disk_write_call_s\":%.4f,\"disk_fsync_s\":%.4f,"
      "\"save_s_median\":%.4f,\"load_cold_s_median\":%.4f,\"disk_write_s_median\":%.4f,\"disk_read_s_median\":%.4f,"
      "\"save_ratio_pair_median\":%.4f,\"load_cold_ratio_pair_median\":%.4f,\"settle_s\":%.1f,"
      "\"disk_write_hot_s\":%s,\"disk_write_hot_gbps\":%.4f,\"save_ratio_hot\":%.4f,\"disk_hot_write_call_s\":%.4f,"
      "\"disk_hot_fsync_s\":%.4f,\"disk_unlink_s\":%.4f",
      s.label.c_str(), r.param.c_str(), r.ranks, cores, r.params, static_cast<unsigned long long>(r.bytes), r.files,
      r.bpp(), s.repeats, list(r.save_s).c_str(), r.save_gbps(), r.disk_write_gbps(), r.save_gbps() / r.disk_write_gbps(),
      list(r.load_cold_s).c_str(), r.cold_gbps(), r.disk_read_gbps(), r.cold_gbps() / r.disk_read_gbps(),
      r.cold_resident, r.disk1.resident, list(r.load_warm_s).c_str(), r.warm_gbps(), list(r.disk1.write_s).c_str(),
      list(r.disk1.read_s).c_str(), r.disk1.write_call_s, r.disk1.fsync_s, median(r.save_s), median(r.load_cold_s),
      median(r.disk1.write_s), median(r.disk1.read_s), r.save_ratio_median(), r.cold_ratio_median(), s.settle_s,
      list(r.disk1.write_hot_s).c_str(), r.disk_write_hot_gbps(), r.save_gbps() / r.disk_write_hot_gbps(),
      r.disk1.hot_write_call_s, r.disk1.hot_fsync_s, r.disk1.unlink_s);
  std::string out = buf;
  if (r.ranks > 1) {
    std::snprintf(buf, sizeof buf, ",\"disk_streams\":%d,\"disk_write_streams_gbps\":%.4f,\"disk_read_streams_gbps\":%.4f",
                  r.diskd.streams, gbps(static_cast<double>(r.diskd.bytes), best(r.diskd.write_s)),
                  gbps(static_cast<double>(r.diskd.bytes), best(r.diskd.read_s)));
    out += buf;
  }
  if (r.has_breakdown) {
    const breakdown& b = r.bd;
    std::snprintf(buf, sizeof buf,
                  ",\"replay_save\":{\"hash_s\":%.4f,\"header_s\":%.4f,\"write_s\":%.4f,\"fsync_s\":%.4f,"
                  "\"rename_s\":%.4f,\"unlink_s\":%.4f},\"replay_load\":{\"stage_alloc_s\":%.4f,\"read_cold_s\":%.4f,"
                  "\"resident\":%.4f,\"hash_s\":%.4f,\"stage_copy_s\":%.4f,\"install_s\":%.4f}",
                  b.hash_s, b.header_s, b.write_s, b.fsync_s, b.rename_s, b.unlink_s, b.stage_alloc_s, b.read_s,
                  b.read_resident, b.check_s, b.stage_copy_s, b.install_s);
    out += buf;
  }
  return out + "}";
}

/// --tp-reshard: a checkpoint saved on TP size `save_tp` loaded warm (right after the save,
/// files in the page cache: memory work only) on each TP size of `load_tps`, DP 1, ranks as
/// threads. The tensors are split as Megatron splits a GPT: qkv, fc, their biases and the
/// embedding by rows (column-parallel, vocab-parallel), proj and fc_proj by columns
/// (row-parallel), layer norms and "rest" whole. Loading on save_tp reads each part's own
/// files (the path of every load before TP resharding); another TP size reads each rank's
/// box from the parts holding it, in runs along rows.
struct tp_load_row {
  int save_tp = 0, load_tp = 0;
  std::size_t bytes = 0;
  double seconds = 0;
  std::size_t same_bytes = 0;  // the checkpoint saved on load_tp itself, loaded there
  double same_seconds = 0;
};

distopt::tp_split megatron_split(const std::string& name) {
  if (name == "rest" || name.ends_with("ln1") || name.ends_with("ln2")) return distopt::tp_split::none;
  return name.ends_with("proj") ? distopt::tp_split::cols : distopt::tp_split::rows;
}

/// Saves (when `save`) or loads `ckpt` R times on a TP grid of `tp`; the best load time.
double tp_grid_run(const settings& s, const fs::path& ckpt, int tp, bool save) {
  using opt_t = distopt::optimizer<distopt::adamw, distopt::sharded<distopt::fp32>, distopt::threads>;
  std::vector<double> times;
  distopt::run_ranks(tp, [&](distopt::threads& world) {
    const int t = world.rank();
    std::optional<distopt::threads> tp_comm, timing;  // the TP group twice: the optimizer's, the barrier's
    if (tp > 1) {
      tp_comm.emplace(world.split(0, t));
      timing.emplace(world.split(0, t));
    }
    distopt::threads dp = tp > 1 ? world.split(t, 0) : std::move(world);
    distopt::layout l;
    const distopt::layout whole = bench::gpt_like(s.params, distopt::dtype::f32);
    for (const auto& x : whole.tensors()) {
      auto shape = x.shape;
      const distopt::tp_split split = tp > 1 ? megatron_split(x.name) : distopt::tp_split::none;
      if (split == distopt::tp_split::rows) shape.front() /= tp;
      if (split == distopt::tp_split::cols) shape.back() /= tp;
      l.add(x.name, shape, distopt::dtype::f32, 0, split);
    }
    opt_t opt(l, distopt::adamw::hyper_params{}, {}, distopt::cpu(1), std::move(dp));
    if (tp_comm) opt.set_tensor_parallel_group(std::move(*tp_comm));
    const auto barrier = [&] {
      std::array<double, 1> v{0};
      if (timing) timing->all_reduce(std::span<double>(v), distopt::reduce_op::max);
    };
    if (save) {
      auto p = opt.params();
      for (std::size_t i = 0; i < p.size(); ++i) p[i] = static_cast<float>((i * 2654435761u) % 1000003) * 1e-7f - 0.05f;
      auto g = opt.grads();
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>((i * 40503u + static_cast<std::size_t>(t)) % 65521) * 1e-8f;
      opt.step();
      opt.save(ckpt);
      return;
    }
    for (int r = 0; r < s.repeats; ++r) {
      barrier();
      const double t0 = now_s();
      opt.load(ckpt);
      barrier();
      if (t == 0) times.push_back(now_s() - t0);
    }
  });
  return best(times);
}

std::vector<tp_load_row> tp_loads(const settings& s, const fs::path& dir) {
  const fs::path ckpt = dir / "ckpt-tp";
  tp_grid_run(s, ckpt, s.save_tp, true);
  const std::size_t bytes = dir_bytes(ckpt);
  std::vector<tp_load_row> out;
  for (int tp : s.load_tps) {
    tp_load_row r{s.save_tp, tp, bytes, tp_grid_run(s, ckpt, tp, false), bytes, 0};
    std::printf("# saved on TP %d, loaded warm on TP %d: %.3f s, %.3f GB/s\n", r.save_tp, r.load_tp, r.seconds,
                gbps(static_cast<double>(bytes), r.seconds));
    std::fflush(stdout);
    const fs::path same = dir / ("ckpt-tp" + std::to_string(tp));
    if (tp != s.save_tp) tp_grid_run(s, same, tp, true);
    r.same_bytes = tp == s.save_tp ? bytes : dir_bytes(same);
    r.same_seconds = tp == s.save_tp ? r.seconds : tp_grid_run(s, same, tp, false);
    std::error_code ec;
    fs::remove_all(same, ec);
    out.push_back(r);
  }
  return out;
}

/// "1,2,4" -> {1, 2, 4}.
std::vector<int> int_list(std::string_view rest) {
  std::vector<int> out;
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    out.push_back(std::atoi(std::string(rest.substr(0, comma)).c_str()));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
  return out;
}

int usage(const char* bad) {
  std::fprintf(stderr,
               "distopt-bench-checkpoint: %s\nusage: distopt-bench-checkpoint [--params N] [--ranks 1,2] "
               "[--precision fp32|bf16|both] [--dir PATH] [--repeats R] [--settle S] [--breakdown on|off] "
               "[--json FILE] [--label L] [--tp-reshard SAVE:LOAD,LOAD...]\n",
               bad);
  return 2;
}

/// Removes the run's directory however the run ends.
struct scratch {
  fs::path path;
  ~scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

int main(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; i += 2) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) return usage("missing value");
    const char* v = argv[i + 1];
    if (a == "--params") s.params = std::strtoull(v, nullptr, 10);
    else if (a == "--repeats") s.repeats = std::atoi(v);
    else if (a == "--precision") s.precision = v;
    else if (a == "--dir") s.dir = v;
    else if (a == "--json") s.json_path = v;
    else if (a == "--label") s.label = v;
    else if (a == "--breakdown") s.breakdown = std::string_view(v) != "off";
    else if (a == "--settle") s.settle_s = std::atof(v);
    else if (a == "--ranks") s.ranks = int_list(v);
    else if (a == "--tp-reshard") {
      const std::string_view text = v;
      const std::size_t colon = text.find(':');
      if (colon == std::string_view::npos) return usage("--tp-reshard: SAVE:LOAD,LOAD...");
      s.save_tp = std::atoi(std::string(text.substr(0, colon)).c_str());
      s.load_tps = int_list(text.substr(colon + 1));
    } else return usage(("unknown option " + std::string(a)).c_str());
  }
  if (s.params == 0 || s.repeats < 1 || s.ranks.empty() || !(s.settle_s >= 0) ||
      std::any_of(s.ranks.begin(), s.ranks.end(), [](int d) { return d < 1 || d > 64; }))
    return usage("invalid value");
  if (s.precision != "fp32" && s.precision != "bf16" && s.precision != "both")
    return usage("--precision: fp32, bf16 or both");
  const auto tp_ok = [](int tp) { return tp >= 1 && tp <= 64 && 1024 % tp == 0; };  // every split dim divides
  if (s.save_tp != 0 && (!tp_ok(s.save_tp) || s.load_tps.empty() || !std::all_of(s.load_tps.begin(), s.load_tps.end(), tp_ok)))
    return usage("--tp-reshard: TP sizes must divide 1024");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  try {
    scratch dir{fs::path(s.dir) / ("distopt-bench-checkpoint-" + std::to_string(::getpid()))};
    fs::create_directories(dir.path);
    std::printf("distopt-bench-checkpoint: adamw, sharded<fp32> states, %zu params (GPT-like tensors), ranks as "
                "threads, 1 executor thread per rank, %d hardware threads, best of %d, files in %s\n",
                s.params, cores, s.repeats, dir.path.c_str());
    std::printf("save: opt.save (write, fsync, rename of each rank file; index.json); load cold: after "
                "posix_fadvise(DONTNEED) of every checkpoint file; warm: right after each save. disk W/R: one file, "
                "new generation written+fsynced, then the previous one unlinked / cold read(), same bytes; d-st: d files by "
                "d threads. ratio: GB/s over the disk's "
                "(best of each); med: median over repeats of each repeat's pair (disk test, then save or cold load). "
                "disk W and save: started %.1f s after memory was last freed; W hot: write()+fsync right after "
                "memory was freed (the page cache reuses those pages)\n",
                s.settle_s);
    std::fflush(stdout);
    if (s.save_tp != 0) {
      std::printf("TP resharding: fp32 AdamW saved on TP %d (DP 1), loaded warm (page cache) on each TP size, best "
                  "of %d; Megatron's GPT splits\n", s.save_tp, s.repeats);
      std::printf("same layout: a checkpoint saved on the loading TP size, loaded there (each part reads its own "
                  "files): the load without resharding\n");
      const auto rows = tp_loads(s, dir.path);
      std::printf("| saved on TP | loaded on TP | bytes | load s | GB/s | same layout: bytes | load s | GB/s | time / same "
                  "layout |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
      for (const auto& r : rows)
        std::printf("| %d | %d | %zu | %.3f | %.3f | %zu | %.3f | %.3f | %.2f |\n", r.save_tp, r.load_tp, r.bytes,
                    r.seconds, gbps(static_cast<double>(r.bytes), r.seconds), r.same_bytes, r.same_seconds,
                    gbps(static_cast<double>(r.same_bytes), r.same_seconds), r.seconds / r.same_seconds);
      return 0;
    }
    std::vector<result> rows;
    const auto each = [&]<class P>(P*) {
      for (int d : s.ranks) rows.push_back(measure<P>(s, dir.path, d));
    };
    if (s.precision != "bf16") each(static_cast<float*>(nullptr));
    if (s.precision != "fp32") each(static_cast<distopt::bf16*>(nullptr));
    print_header();
    for (const auto& r : rows) print_row(r);
    for (const auto& r : rows) print_breakdown(r);
    std::printf("\n");
    std::FILE* f = s.json_path.empty() ? nullptr : std::fopen(s.json_path.c_str(), "a");
    for (const auto& r : rows) {
      const std::string line = json(r, s, cores);
      std::printf("%s\n", line.c_str());
      if (f) std::fprintf(f, "%s\n", line.c_str());
    }
    if (f) std::fclose(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distopt-bench-checkpoint: %s\n", e.what());
    return 1;
  }
  return 0;
}
