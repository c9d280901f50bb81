// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Writes the fuzz targets' seed corpus (tests/fuzz/corpus): the index.json, the rank file
// and its "distopt.items" metadata of a real checkpoint (a two-step AdamW run with two
// tensors, saved on one rank), plus near-valid variants of each and a few edge cases
// (empty, truncated, a huge header length). Usage: make_corpus OUT_DIR (OUT_DIR gets
// safetensors/, checkpoint_index/ and checkpoint_items/; existing files are overwritten).
#include <distopt/checkpoint.hpp>
#include <distopt/distopt.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <unistd.h>
#include <vector>

namespace fs = std::filesystem;

namespace {

void write_file(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// A safetensors file: the 8-byte little-endian length of `header`, `header`, `data`.
std::string safetensors(std::string_view header, std::string_view data = {}, std::uint64_t length = ~std::uint64_t{0}) {
  if (length == ~std::uint64_t{0}) length = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &length, 8);
  out += header;
  out += data;
  return out;
}

/// `depth` nested JSON arrays.
std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

/// `index` (index.json text) with its "checksum" recomputed after `edit` changed it.
template <class Edit>
std::string reindexed(const std::string& index, Edit edit) {
  nlohmann::json j = nlohmann::json::parse(index);
  j.erase("checksum");
  edit(j);
  const std::string body = j.dump();
  j["checksum"] = distopt::io::detail::hex64(distopt::io::detail::xxh3(body.data(), body.size()));
  return j.dump(1) + "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_corpus OUT_DIR\n";
    return 2;
  }
  const fs::path out = argv[1];
  const fs::path st = out / "safetensors", idx = out / "checkpoint_index", items = out / "checkpoint_items";
  for (const auto& d : {st, idx, items}) fs::create_directories(d);

  // A real checkpoint: AdamW, sharded fp32 states, one rank, two tensors, two steps.
  const fs::path dir = fs::temp_directory_path() / ("distopt-make-corpus-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  {
    using namespace distopt;
    layout l;
    l.add("w", {3, 2}, dtype::f32);
    l.add("b", {2}, dtype::f32);
    adamw::hyper_params h;
    h.lr = 1e-2;
    optimizer<adamw, sharded<fp32>, single> opt(l, h);
    for (const auto& t : opt.tensors().tensors()) {
      auto p = opt.param(t.name);
      for (std::size_t i = 0; i < p.size(); ++i) p[i] = 0.25f * static_cast<float>(i + 1);
    }
    for (int s = 0; s < 2; ++s) {
      for (const auto& t : opt.tensors().tensors()) {
        auto g = opt.grad(t.name);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.125f * static_cast<float>(i + s) - 0.3f;
      }
      opt.step();
      opt.zero_grad();
    }
    opt.save(dir);
  }
  fs::path rank;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") rank = e.path();
  const std::string index = read_file(dir / "index.json");
  const std::string rank_bytes = read_file(rank);
  const auto reader = distopt::io::safetensors_reader::open(rank);
  const std::string item_text = reader.metadata().at("distopt.items");
  fs::remove_all(dir);

  // safetensors: the rank file, files from the writer, and malformed layouts.
  write_file(st / "rank_file.safetensors", rank_bytes);
  {
    distopt::io::safetensors_writer w;
    w.set_metadata("note", "dtypes");
    const std::vector<float> f32{1.5f, -2.0f};
    w.add_f32("f32", {2}, f32);
    const unsigned char half[4] = {0x80, 0x3f, 0x00, 0x3c};  // bf16 1.0, f16 1.0
    w.add("bf16", "BF16", {1}, std::as_bytes(std::span(half, 2)));
    w.add("f16", "F16", {}, std::as_bytes(std::span(half + 2, 2)));
    const double f64 = 3.25;
    w.add("f64", "F64", {1, 1}, std::as_bytes(std::span(&f64, 1)));
    w.add("empty", "I64", {0, 5}, {});
    const unsigned char u8[3] = {1, 2, 3};
    w.add("u8", "U8", {3}, std::as_bytes(std::span(u8)));
    w.write(st / "dtypes.safetensors");
  }
  write_file(st / "no_tensors.safetensors", safetensors("{}"));
  write_file(st / "empty.safetensors", "");
  write_file(st / "short_length.safetensors", std::string("\x02\x00\x00", 3));
  write_file(st / "truncated.safetensors", rank_bytes.substr(0, rank_bytes.size() - 7));
  write_file(st / "huge_header_length.safetensors", safetensors("{}", {}, ~std::uint64_t{0} - 1));
  write_file(st / "overlap.safetensors",
             safetensors(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
                         "abc"));
  write_file(st / "hole.safetensors",
             safetensors(R"({"a":{"dtype":"F16","shape":[1],"data_offsets":[2,4]},"__metadata__":{"k":"v"}})", "abcd"));
  write_file(st / "duplicate_key.safetensors",
             safetensors(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                         "x"));
  write_file(st / "shape_overflow.safetensors",
             safetensors(R"({"a":{"dtype":"F64","shape":[0,9223372036854775807,3],"data_offsets":[0,0]}})"));
  write_file(st / "deep_nesting.safetensors",  // once overflowed the stack (dump() recurses)
             safetensors(R"({"a":{"dtype":"F32","shape":)" + nested(200) + R"(,"data_offsets":[0,0]}})"));
  write_file(st / "bad_entry.safetensors",
             safetensors(R"({"a":{"dtype":"F4","shape":[-1,1.5],"data_offsets":[3,1],"x":null},"__metadata__":{"k":1}})"));

  // index.json: the real one, a corrupt checksum, and near-valid ones with a right checksum.
  write_file(idx / "index.json", index);
  {
    std::string corrupt = index;
    const auto at = corrupt.find("\"checksum\": \"") + 13;
    corrupt[at] = corrupt[at] == '0' ? '1' : '0';
    write_file(idx / "bad_checksum.json", corrupt);
  }
  write_file(idx / "format_version_2.json", reindexed(index, [](nlohmann::json& j) { j["format_version"] = 2; }));
  write_file(idx / "dp_size_2.json", reindexed(index, [](nlohmann::json& j) { j["dp_size"] = 2; }));
  write_file(idx / "tp_size_0.json", reindexed(index, [](nlohmann::json& j) { j["tp_size"] = 0; }));
  write_file(idx / "path_in_name.json",
             reindexed(index, [](nlohmann::json& j) { j["files"][0][0]["file"] = "../index.json"; }));
  write_file(idx / "header_hash_short.json",
             reindexed(index, [](nlohmann::json& j) { j["files"][0][0]["header_xxh3"] = "abc"; }));
  write_file(idx / "state_not_string.json", reindexed(index, [](nlohmann::json& j) { j["state"]["step"] = 2; }));
  write_file(idx / "no_checksum.json", "{\"format\": \"distopt-checkpoint\"}\n");
  write_file(idx / "deep_nesting.json",  // once overflowed the stack (dump() recurses)
             R"({"checksum":"0000000000000000","format":"distopt-checkpoint","identity":{"x":)" + nested(200) + "}}\n");
  write_file(idx / "empty.json", "");
  write_file(idx / "truncated.json", index.substr(0, index.size() / 2));

  // distopt.items: the real one and near-valid records.
  write_file(items / "items.json", item_text);
  write_file(items / "two_chunks.json",
             R"({"x/state.0":{"dtype":"F32","total":300000,"first":200000,"count":100000,"shape":[600,500],)"
             R"("xxh3":["0123456789abcdef","fedcba9876543210"]}})");
  write_file(items / "empty_slice.json",
             R"({"e/param":{"dtype":"BF16","total":0,"first":0,"count":0,"shape":[0,7],"xxh3":[]}})");
  // Once accepted, with the dimension turned into -1 (fixed; the fuzz target checks it).
  write_file(items / "huge_dimension_after_zero.json",
             R"({"e/param":{"dtype":"F32","total":0,"first":0,"count":0,"shape":[0,18446744073709551615],"xxh3":[]}})");
  write_file(items / "slice_exceeds.json",
             R"({"w/param":{"dtype":"F32","total":6,"first":4,"count":3,"shape":[3,2],"xxh3":["0000000000000000"]}})");
  write_file(items / "shape_mismatch.json",
             R"({"w/param":{"dtype":"F32","total":6,"first":0,"count":6,"shape":[4,2],"xxh3":["0000000000000000"]}})");
  write_file(items / "bad_hash.json",
             R"({"w/param":{"dtype":"F32","total":6,"first":0,"count":6,"shape":[6],"xxh3":["000000000000000G"]}})");
  write_file(items / "wrong_types.json", R"({"w/param":{"dtype":4,"total":-6,"first":"0","shape":{},"xxh3":null}})");
  write_file(items / "deep_nesting.json", R"({"x":{"dtype":"F32","total":1,"first":0,"count":1,"shape":)" +
                                               nested(200) + R"(,"xxh3":["0000000000000000"]}})");
  // TP boxes: one inside its whole array, and near-valid ones.
  write_file(items / "tp_box.json",
             R"({"x/state.0":{"dtype":"F32","total":12,"first":0,"count":12,"shape":[3,4],"xxh3":["0123456789abcdef"],"tp":{"whole":[3,8],"box":[3,4],"offset":[0,4]}}})");
  write_file(items / "tp_box_outside.json",
             R"({"x/state.0":{"dtype":"F32","total":12,"first":0,"count":12,"shape":[3,4],"xxh3":["0123456789abcdef"],"tp":{"whole":[3,8],"box":[3,4],"offset":[0,5]}}})");
  write_file(items / "tp_box_rank_mismatch.json",
             R"({"x/param":{"dtype":"F32","total":12,"first":0,"count":12,"shape":[12],"xxh3":["0123456789abcdef"],"tp":{"whole":[3,8],"box":[12],"offset":[0,0]}}})");
  write_file(items / "tp_box_huge.json",
             R"({"x/param":{"dtype":"F32","total":12,"first":0,"count":12,"shape":[12],"xxh3":["0123456789abcdef"],"tp":{"whole":[4611686018427387904,4611686018427387904],"box":[4611686018427387904,4611686018427387904],"offset":[0,0]}}})");
  write_file(items / "not_object.json", "[1, 2, 3]");
  write_file(items / "empty.json", "");
  std::cout << "make_corpus: wrote " << st << ", " << idx << " and " << items << "\n";
  return 0;
}
