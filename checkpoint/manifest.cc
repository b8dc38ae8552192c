// checkpoint/manifest.cc — JSON form, validation and merging of manifests.
#include "checkpoint/manifest.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <charconv>

namespace troupe::checkpoint {

using nlohmann::json;

std::string shard_file_name(int rank) { return fmt::format("rank_{:05d}.bin", rank); }
std::string part_file_name(int rank) { return fmt::format("rank_{:05d}.part.json", rank); }
std::string step_dir_name(int64_t step) { return fmt::format("step_{}", step); }
std::string tmp_dir_name(int64_t step) { return fmt::format("step_{}.tmp", step); }

std::optional<int64_t> parse_step_dir_name(std::string_view name) {
  constexpr std::string_view kPrefix = "step_";
  if (name.substr(0, kPrefix.size()) != kPrefix || name.size() == kPrefix.size()) return std::nullopt;
  std::string_view digits = name.substr(kPrefix.size());
  int64_t v = 0;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || p != digits.data() + digits.size() || v < 0) return std::nullopt;
  return v;
}

uint64_t Manifest::total_bytes() const {
  uint64_t b = 0;
  for (const auto& [name, t] : tensors)
    for (const StoredSlice& s : t.slices) b += s.length;
  return b;
}

std::string xxh64_hex(uint64_t h) { return fmt::format("{:016x}", h); }

namespace {

Result<uint64_t> parse_hex64(const std::string& s) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (s.size() != 16 || ec != std::errc() || p != s.data() + s.size()) {
    return invalid_argument("'{}' is not a 16-digit hex checksum", s);
  }
  return v;
}

// The JSON keys are the on-disk format (a coordinate's pp is stored as "stage"): they
// stay as they are so every checkpoint written so far still loads.
json layout_to_json(const ParallelLayout& l) {
  return json{{"pp", l.pp()}, {"dp", l.dp()}, {"n", l.n()}};
}
json coords_to_json(const ParallelCoord& c) {
  return json{{"stage", c.pp}, {"dp", c.dp}, {"n", c.n}};
}

json tensor_to_json(const TensorRecord& t) {
  json slices = json::array();
  for (const StoredSlice& s : t.slices) {
    json box = json::array();
    for (const Range& r : s.box) box.push_back(json::array({r.start, r.length}));
    slices.push_back(json{{"file", s.file},     {"offset", s.offset}, {"length", s.length},
                          {"box", box},         {"xxh64", xxh64_hex(s.xxh64)}, {"rank", s.rank}});
  }
  return json{{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"slices", slices}};
}

// The JSON readers throw nlohmann exceptions on missing keys or wrong types; the public
// entry points catch them and turn them into DataLoss naming the source.
Result<ParallelLayout> layout_from_json(const json& j, std::string_view where) {
  Result<ParallelLayout> l =
      ParallelLayout::make(j.at("pp").get<int64_t>(), j.at("dp").get<int64_t>(), j.at("n").get<int64_t>());
  if (!l.ok()) return data_loss("{}: {}", where, l.status().message());
  return l;
}
ParallelCoord coords_from_json(const json& j) {
  return ParallelCoord{j.at("stage").get<int>(), j.at("dp").get<int>(), j.at("n").get<int>()};
}

Result<TensorRecord> tensor_from_json(const std::string& name, const json& j, std::string_view where) {
  TensorRecord t;
  t.name = name;
  const std::string dt = j.at("dtype").get<std::string>();
  auto dtype = dtype_from_name(dt);
  if (!dtype) return data_loss("{}: tensor '{}' has unknown dtype '{}'", where, name, dt);
  t.dtype = *dtype;
  t.shape = j.at("shape").get<Shape>();
  for (const json& js : j.at("slices")) {
    StoredSlice s;
    s.file = js.at("file").get<std::string>();
    s.offset = js.at("offset").get<uint64_t>();
    s.length = js.at("length").get<uint64_t>();
    for (const json& r : js.at("box")) {
      if (!r.is_array() || r.size() != 2) return data_loss("{}: tensor '{}' has a malformed box", where, name);
      s.box.push_back(Range{r[0].get<int64_t>(), r[1].get<int64_t>()});
    }
    auto h = parse_hex64(js.at("xxh64").get<std::string>());
    if (!h.ok()) return data_loss("{}: tensor '{}': {}", where, name, h.status().message());
    s.xxh64 = *h;
    s.rank = js.at("rank").get<int>();
    if (s.file.empty() || s.file.find('/') != std::string::npos || s.file == "." || s.file == "..") {
      return data_loss("{}: tensor '{}' names shard file '{}', which is not a plain file name", where, name, s.file);
    }
    t.slices.push_back(std::move(s));
  }
  return t;
}

}  // namespace

json part_to_json(const ManifestPart& p) {
  json tensors = json::object();
  for (const TensorRecord& t : p.tensors) tensors[t.name] = tensor_to_json(t);
  return json{{"format", "troupe-checkpoint-part"},
              {"format_version", kFormatVersion},
              {"step", p.step},
              {"rank", p.rank},
              {"world_size", p.world_size},
              {"layout", layout_to_json(p.layout)},
              {"coords", coords_to_json(p.coords)},
              {"state", p.state},
              {"tensors", tensors}};
}

Result<ManifestPart> part_from_json(const json& j, std::string_view where) {
  try {
    if (j.at("format").get<std::string>() != "troupe-checkpoint-part") {
      return data_loss("{}: not a checkpoint manifest part", where);
    }
    const int version = j.at("format_version").get<int>();
    if (version < kOldestFormatVersion || version > kFormatVersion) {
      return data_loss("{}: format version {} (this build reads {} to {})", where, version,
                       kOldestFormatVersion, kFormatVersion);
    }
    ManifestPart p;
    p.step = j.at("step").get<int64_t>();
    p.rank = j.at("rank").get<int>();
    p.world_size = j.at("world_size").get<int>();
    TROUPE_ASSIGN_OR_RETURN(p.layout, layout_from_json(j.at("layout"), where));
    p.coords = coords_from_json(j.at("coords"));
    p.state = j.at("state");
    for (const auto& [name, jt] : j.at("tensors").items()) {
      TROUPE_ASSIGN_OR_RETURN(TensorRecord t, tensor_from_json(name, jt, where));
      TROUPE_RETURN_IF_ERROR(validate_tensor_record(t, /*require_coverage=*/false, where));
      p.tensors.push_back(std::move(t));
    }
    return p;
  } catch (const json::exception& e) {
    return data_loss("{}: malformed manifest part: {}", where, e.what());
  }
}

json manifest_to_json(const Manifest& m) {
  json ranks = json::array();
  for (const RankRecord& r : m.ranks) {
    ranks.push_back(json{{"rank", r.rank}, {"coords", coords_to_json(r.coords)}, {"state", r.state}});
  }
  json tensors = json::object();
  for (const auto& [name, t] : m.tensors) tensors[name] = tensor_to_json(t);
  json tok = nullptr;
  if (m.tokenizer) {
    tok = json{{"file", m.tokenizer->file}, {"bytes", m.tokenizer->bytes}, {"xxh64", xxh64_hex(m.tokenizer->xxh64)}};
  }
  json j{{"format", "troupe-checkpoint"},
         {"format_version", kFormatVersion},
         {"step", m.step},
         {"layout", layout_to_json(m.layout)},
         {"world_size", m.world_size},
         {"created_unix_ms", m.created_unix_ms},
         {"data_position", m.data_position},
         {"config_text", m.config_text},
         {"tokenizer", tok},
         {"metadata", m.metadata},
         {"ranks", ranks},
         {"tensors", tensors}};
  j["checksum"] = manifest_checksum(j);
  return j;
}

std::string manifest_checksum(const json& j) {
  json body = j;
  if (body.is_object()) body.erase("checksum");
  const std::string text = body.dump();  // objects dump with sorted keys: one spelling
  return xxh64_hex(XXH64(text.data(), text.size(), 0));
}

Result<Manifest> manifest_from_json(const json& j, std::string_view where) {
  try {
    if (!j.is_object() || j.value("format", std::string()) != "troupe-checkpoint") {
      return data_loss("{}: not a Troupe checkpoint manifest", where);
    }
    Manifest m;
    m.format_version = j.at("format_version").get<int>();
    if (m.format_version < kOldestFormatVersion || m.format_version > kFormatVersion) {
      return data_loss("{}: format version {} (this build reads {} to {})", where, m.format_version,
                       kOldestFormatVersion, kFormatVersion);
    }
    if (m.format_version >= 2) {
      if (!j.contains("checksum") || !j["checksum"].is_string()) {
        return data_loss("{}: the manifest carries no checksum (format version {} needs one)", where,
                         m.format_version);
      }
      const std::string want = j["checksum"].get<std::string>(), got = manifest_checksum(j);
      if (want != got) {
        return data_loss("{}: the manifest was edited or damaged: its checksum is {}, its content's {}",
                         where, want, got);
      }
    }
    m.step = j.at("step").get<int64_t>();
    TROUPE_ASSIGN_OR_RETURN(m.layout, layout_from_json(j.at("layout"), where));
    m.world_size = j.at("world_size").get<int>();
    m.created_unix_ms = j.at("created_unix_ms").get<int64_t>();
    m.data_position = j.at("data_position");
    m.config_text = j.at("config_text").get<std::string>();
    if (!j.at("tokenizer").is_null()) {
      const json& t = j.at("tokenizer");
      TokenizerRecord tr;
      tr.file = t.at("file").get<std::string>();
      tr.bytes = t.at("bytes").get<uint64_t>();
      auto h = parse_hex64(t.at("xxh64").get<std::string>());
      if (!h.ok()) return data_loss("{}: tokenizer: {}", where, h.status().message());
      tr.xxh64 = *h;
      m.tokenizer = tr;
    }
    m.metadata = j.at("metadata");
    for (const json& r : j.at("ranks")) {
      m.ranks.push_back(RankRecord{r.at("rank").get<int>(), coords_from_json(r.at("coords")), r.at("state")});
    }
    for (const auto& [name, jt] : j.at("tensors").items()) {
      TROUPE_ASSIGN_OR_RETURN(TensorRecord t, tensor_from_json(name, jt, where));
      TROUPE_RETURN_IF_ERROR(validate_tensor_record(t, /*require_coverage=*/true, where));
      m.tensors.emplace(name, std::move(t));
    }
    return m;
  } catch (const json::exception& e) {
    return data_loss("{}: malformed manifest: {}", where, e.what());
  }
}

Status validate_tensor_record(const TensorRecord& t, bool require_coverage, std::string_view where) {
  for (int64_t d : t.shape) {
    if (d < 0) return data_loss("{}: tensor '{}' has negative dimension in {}", where, t.name, shape_to_string(t.shape));
  }
  const size_t esize = dtype_size(t.dtype);
  for (const StoredSlice& s : t.slices) {
    Status st = check_slice_within(s.box, t.shape, fmt::format("tensor '{}'", t.name));
    if (!st.ok()) return data_loss("{}: {}", where, st.message());
    const uint64_t want = static_cast<uint64_t>(slice_numel(s.box)) * esize;
    if (s.length != want) {
      return data_loss("{}: tensor '{}' slice {} in {} has length {} bytes, its box needs {}", where, t.name,
                       slice_to_string(s.box), s.file, s.length, want);
    }
  }
  if (!require_coverage) return ok_status();
  // Distinct boxes must not overlap and must add up to the whole tensor.
  std::vector<const Slice*> distinct;
  for (const StoredSlice& s : t.slices) {
    if (std::none_of(distinct.begin(), distinct.end(), [&](const Slice* b) { return *b == s.box; })) {
      distinct.push_back(&s.box);
    }
  }
  int64_t covered = 0;
  for (size_t i = 0; i < distinct.size(); ++i) {
    covered += slice_numel(*distinct[i]);
    for (size_t k = i + 1; k < distinct.size(); ++k) {
      auto ov = intersect(*distinct[i], *distinct[k]);
      if (ov && slice_numel(*ov) > 0) {
        return data_loss("{}: tensor '{}' has stored slices {} and {} that partly overlap", where, t.name,
                         slice_to_string(*distinct[i]), slice_to_string(*distinct[k]));
      }
    }
  }
  if (covered != shape_numel(t.shape)) {
    return data_loss("{}: tensor '{}' {}: stored slices cover {} of {} elements", where, t.name,
                     shape_to_string(t.shape), covered, shape_numel(t.shape));
  }
  return ok_status();
}

Result<Manifest> merge_parts(const std::vector<ManifestPart>& parts, const CheckpointInfo& info) {
  if (parts.empty()) return invalid_argument("merge_parts: no parts");
  Manifest m;
  m.step = parts[0].step;
  m.layout = parts[0].layout;
  m.world_size = parts[0].world_size;
  if (static_cast<int>(parts.size()) != m.world_size) {
    return failed_precondition("step {}: {} manifest parts for a world of {}", m.step, parts.size(), m.world_size);
  }
  m.data_position = info.data_position;
  m.config_text = info.config_text;
  m.metadata = info.metadata;
  for (size_t r = 0; r < parts.size(); ++r) {
    const ManifestPart& p = parts[r];
    if (p.rank != static_cast<int>(r) || p.step != m.step || p.world_size != m.world_size || !(p.layout == m.layout)) {
      return data_loss("step {}: manifest part of rank {} (step {}, world {}, layout {}) disagrees with rank 0 "
                       "(step {}, world {}, layout {})",
                       m.step, p.rank, p.step, p.world_size, p.layout.to_string(), m.step, m.world_size,
                       m.layout.to_string());
    }
    m.ranks.push_back(RankRecord{p.rank, p.coords, p.state});
    for (const TensorRecord& t : p.tensors) {
      auto [it, inserted] = m.tensors.emplace(t.name, TensorRecord{t.name, t.dtype, t.shape, {}});
      if (!inserted && (it->second.dtype != t.dtype || it->second.shape != t.shape)) {
        return data_loss("step {}: tensor '{}' is {} {} on rank {} but {} {} on an earlier rank", m.step, t.name,
                         dtype_name(t.dtype), shape_to_string(t.shape), p.rank, dtype_name(it->second.dtype),
                         shape_to_string(it->second.shape));
      }
      it->second.slices.insert(it->second.slices.end(), t.slices.begin(), t.slices.end());
    }
  }
  for (const auto& [name, t] : m.tensors) {
    TROUPE_RETURN_IF_ERROR(validate_tensor_record(t, /*require_coverage=*/true, fmt::format("step {}", m.step)));
  }
  return m;
}

}  // namespace troupe::checkpoint
