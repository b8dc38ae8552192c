// checkpoint/tools/inspect.cc — troupe-ckpt: prints checkpoints in human form.
//   troupe-ckpt inspect <checkpoint dir | run dir> [--verify]   the manifest (newest of a run)
//   troupe-ckpt list <run dir>                                   the run's checkpoints
// Exit status 0 when everything shown is intact, 1 otherwise (the reason is printed).
#include <fmt/chrono.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>

#include "checkpoint/file_io.h"
#include "checkpoint/reader.h"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::checkpoint;

namespace {

std::string human_bytes(uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", static_cast<double>(b) / (1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.2f} MiB", static_cast<double>(b) / (1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.1f} KiB", static_cast<double>(b) / (1ull << 10));
  return fmt::format("{} B", b);
}

std::string one_line(const nlohmann::json& j) {
  std::string s = j.dump();
  return s.size() > 200 ? s.substr(0, 197) + "..." : s;
}

int inspect(const std::string& path, bool verify) {
  std::string dir = path;
  if (!fs::exists(fs::path(path) / kManifestFile)) {
    auto all = list_checkpoints(path);
    if (all.empty()) {
      fmt::print(stderr, "error: {} holds no manifest.json and no step_<N> checkpoint\n", path);
      return 1;
    }
    dir = all.front().second;
    fmt::print("run {}: {} checkpoint(s); showing the newest\n", path, all.size());
  }
  auto r = CheckpointReader::open(dir, VerifyMode::kManifestOnly);
  if (!r.ok()) {
    fmt::print(stderr, "error: {}\n", r.status().to_string());
    return 1;
  }
  const Manifest& m = (*r)->manifest();
  const auto created = std::chrono::system_clock::time_point(std::chrono::milliseconds(m.created_unix_ms));
  fmt::print("checkpoint {}\n", dir);
  fmt::print("  step {}   format {}   created {:%Y-%m-%d %H:%M:%S} UTC\n", m.step, m.format_version,
             fmt::gmtime(std::chrono::system_clock::to_time_t(created)));
  fmt::print("  layout {} ({} ranks)\n", m.layout.to_string(), m.world_size);
  fmt::print("  data position {}\n", one_line(m.data_position));
  if (m.tokenizer) {
    fmt::print("  tokenizer {} ({}, xxh64 {})\n", m.tokenizer->file, human_bytes(m.tokenizer->bytes),
               xxh64_hex(m.tokenizer->xxh64));
  } else {
    fmt::print("  tokenizer none\n");
  }
  const auto lines = std::count(m.config_text.begin(), m.config_text.end(), '\n');
  fmt::print("  config {} bytes, {} lines\n", m.config_text.size(), lines);
  fmt::print("  metadata {}\n", one_line(m.metadata));
  fmt::print("  ranks:\n");
  for (const RankRecord& rr : m.ranks) {
    fmt::print("    {:>4}  ({})  state {}\n", rr.rank, rr.coords.to_string(), one_line(rr.state));
  }
  fmt::print("  tensors: {}, {} stored\n", m.tensors.size(), human_bytes(m.total_bytes()));
  int bad = 0, checked = 0;
  Status files = (*r)->check_files();
  if (!files.ok()) {
    fmt::print("  FILES: {}\n", files.to_string());
    ++bad;
  }
  for (const auto& [name, t] : m.tensors) {
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(t.shape)) * dtype_size(t.dtype);
    fmt::print("    {:<40} {:<6} {:<20} {:>10}  {} slice(s)\n", name, dtype_name(t.dtype),
               shape_to_string(t.shape), human_bytes(bytes), t.slices.size());
    for (const StoredSlice& s : t.slices) {
      std::string mark;
      if (verify) {
        ++checked;
        Status st = (*r)->verify_slice(t, s);
        mark = st.ok() ? "  ok" : "  BAD: " + st.message();
        if (!st.ok()) ++bad;
      }
      fmt::print("      {:<24} rank {:>3}  {} @{} +{}  xxh64 {}{}\n", slice_to_string(s.box), s.rank, s.file,
                 s.offset, s.length, xxh64_hex(s.xxh64), mark);
    }
  }
  if (verify) {
    if (m.tokenizer) {
      Status st = (*r)->verify_checksums();
      if (!st.ok() && bad == 0) {
        fmt::print("  BAD: {}\n", st.message());
        ++bad;
      }
    }
    fmt::print("checksums: {} slice(s) checked, {}\n", checked,
               bad == 0 ? "all ok" : fmt::format("{} problem(s)", bad));
  }
  return bad == 0 ? 0 : 1;
}

int list(const std::string& run_dir) {
  auto all = list_checkpoints(run_dir);
  if (all.empty()) {
    fmt::print("{}: no checkpoints\n", run_dir);
    return 1;
  }
  auto latest = read_whole_file((fs::path(run_dir) / kLatestFile).string());
  fmt::print("{}: latest -> {}", run_dir, latest.ok() ? *latest : "(none)\n");
  for (const auto& [step, path] : all) {
    auto r = CheckpointReader::open(path, VerifyMode::kStructure);
    if (r.ok()) {
      fmt::print("  step {:>8}  {}  layout {}  {} tensors  {}\n", step, path, (*r)->layout().to_string(),
                 (*r)->manifest().tensors.size(), human_bytes((*r)->manifest().total_bytes()));
    } else {
      fmt::print("  step {:>8}  {}  INVALID: {}\n", step, path, r.status().to_string());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe-ckpt: inspect Troupe checkpoints"};
  app.require_subcommand(1);
  std::string dir;
  bool verify = false;
  auto* ins = app.add_subcommand("inspect", "print a checkpoint's manifest");
  ins->add_option("dir", dir, "checkpoint directory, or a run directory (its newest checkpoint)")->required();
  ins->add_flag("--verify", verify, "read every slice and check its checksum");
  auto* ls = app.add_subcommand("list", "list the checkpoints of a run directory");
  ls->add_option("run_dir", dir, "run directory")->required();
  CLI11_PARSE(app, argc, argv);
  if (ins->parsed()) return inspect(dir, verify);
  return list(dir);
}
