// interop/hf_checkpoint.cc — import (HfCheckpoint) and export (export_hf) of Hugging Face
// model directories.
#include "interop/hf_checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include "checkpoint/file_io.h"

namespace troupe::interop {

namespace fs = std::filesystem;
using checkpoint::Range;
using checkpoint::Slice;
using nlohmann::json;

namespace {

Result<json> read_json(const std::string& path) {
  TROUPE_ASSIGN_OR_RETURN(std::string text, checkpoint::read_whole_file(path));
  try {
    return json::parse(text);
  } catch (const std::exception& e) {
    return data_loss("{}: not valid JSON: {}", path, e.what());
  }
}

// Tensors a checkpoint may hold that Troupe's model has no use for and transformers
// itself ignores: precomputed RoPE frequencies of older saves.
bool ignorable(const std::string& name) {
  return name.size() > 20 && name.ends_with("rotary_emb.inv_freq");
}

}  // namespace

Result<std::unique_ptr<HfCheckpoint>> HfCheckpoint::open(const std::string& dir) {
  if (!fs::is_directory(dir))
    return not_found("{} is not a directory (a Hugging Face model directory was expected)", dir);
  std::unique_ptr<HfCheckpoint> c(new HfCheckpoint());
  c->dir_ = dir;
  const std::string cfg_path = dir + "/config.json";
  if (!fs::exists(cfg_path)) return not_found("{}: no config.json (not a Hugging Face model directory)", dir);
  TROUPE_ASSIGN_OR_RETURN(json cfg, read_json(cfg_path));
  TROUPE_ASSIGN_OR_RETURN(c->config_, parse_hf_config(cfg, cfg_path));
  // The weights: an index naming the shards, or one model.safetensors.
  std::vector<std::string> files;
  const std::string index = dir + "/model.safetensors.index.json";
  if (fs::exists(index)) {
    TROUPE_ASSIGN_OR_RETURN(json idx, read_json(index));
    if (!idx.contains("weight_map") || !idx["weight_map"].is_object()) {
      return data_loss("{}: no weight_map object", index);
    }
    std::set<std::string> seen;
    for (const auto& [name, file] : idx["weight_map"].items()) {
      if (!file.is_string()) return data_loss("{}: weight_map['{}'] is not a file name", index, name);
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f.starts_with(".")) {
        return data_loss("{}: weight_map['{}'] = '{}' is not a file of the directory", index, name, f);
      }
      if (seen.insert(f).second) files.push_back(f);
    }
  } else if (fs::exists(dir + "/model.safetensors")) {
    files.push_back("model.safetensors");
  } else {
    std::string found;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().extension() == ".bin" || e.path().extension() == ".pth")
        found = e.path().filename().string();
    }
    return not_found("{}: neither model.safetensors nor model.safetensors.index.json{}", dir,
                     found.empty() ? ""
                                   : fmt::format(" (found {}: PyTorch pickles are not read; save with "
                                                 "safe_serialization=True)",
                                                 found));
  }
  for (const std::string& f : files) {
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> sf, SafetensorsFile::open(dir + "/" + f));
    for (const auto& [name, info] : sf->tensors()) {
      if (c->tensors_.count(name))
        return data_loss("{}: tensor '{}' is stored twice (also in another file)", dir, name);
      c->tensors_[name] = Loc{sf.get(), &info};
      if (name.find(".experts.gate_up_proj") != std::string::npos) c->fused_ = true;
    }
    c->files_.push_back(std::move(sf));
  }
  return c;
}

Result<HfCheckpoint::Loc> HfCheckpoint::find(const std::string& hf_name) const {
  auto it = tensors_.find(hf_name);
  if (it == tensors_.end()) return not_found("{} holds no tensor '{}'", dir_, hf_name);
  return it->second;
}

bool same_architecture(const layers::ModelConfig& a, const layers::ModelConfig& b, std::string* why) {
  const auto differ = [&](const char* key, const std::string& x, const std::string& y) {
    if (why) *why = fmt::format("model.{} is {} here but {} in the checkpoint", key, x, y);
    return false;
  };
#define TROUPE_SAME(key, expr_a, expr_b) \
  if ((expr_a) != (expr_b)) return differ(key, fmt::format("{}", expr_a), fmt::format("{}", expr_b))
  TROUPE_SAME("vocab_size", a.vocab_size, b.vocab_size);
  TROUPE_SAME("d_model", a.d_model, b.d_model);
  TROUPE_SAME("n_layers", a.n_layers, b.n_layers);
  TROUPE_SAME("n_heads", a.n_heads, b.n_heads);
  TROUPE_SAME("n_kv_heads", a.n_kv_heads, b.n_kv_heads);
  TROUPE_SAME("head_dim", a.dh(), b.dh());
  TROUPE_SAME("tie_embeddings", a.tie_embeddings, b.tie_embeddings);
  TROUPE_SAME("rope_theta", a.rope_theta, b.rope_theta);
  TROUPE_SAME("norm_eps", a.norm_eps, b.norm_eps);
  TROUPE_SAME("qk_norm", a.qk_norm, b.qk_norm);
  bool any_dense = false, any_moe = false;
  for (int64_t i = 0; i < a.n_layers; ++i) {
    if (a.is_moe_block(i) != b.is_moe_block(i)) {
      return differ("moe_layers", fmt::format("block {} {}", i, a.is_moe_block(i) ? "MoE" : "dense"),
                    b.is_moe_block(i) ? "MoE" : "dense");
    }
    (a.is_moe_block(i) ? any_moe : any_dense) = true;
  }
  if (any_dense) TROUPE_SAME("ffn_hidden", a.ffn_hidden, b.ffn_hidden);
  if (any_moe) {
    TROUPE_SAME("moe.num_experts", a.moe.num_experts, b.moe.num_experts);
    TROUPE_SAME("moe.top_k", a.moe.top_k, b.moe.top_k);
    TROUPE_SAME("moe.expert_hidden", a.moe.expert_hidden, b.moe.expert_hidden);
    const auto router = [](const layers::ModelConfig& c) {
      return std::string(c.moe.score == kernels::RouterScore::kSigmoid ? "sigmoid" : "softmax");
    };
    TROUPE_SAME("moe.router", router(a), router(b));
    TROUPE_SAME("moe.normalize_gates", a.moe.normalize_gates, b.moe.normalize_gates);
    TROUPE_SAME("moe.shared_experts", a.moe.shared_experts, b.moe.shared_experts);
  }
#undef TROUPE_SAME
  return true;
}

Status HfCheckpoint::validate(const layers::ModelConfig& m) const {
  std::string why;
  if (!same_architecture(m, config_.model, &why)) {
    return failed_precondition("{}: the run's model is not the checkpoint's: {}", dir_, why);
  }
  std::set<std::string> used;
  for (const TroupeTensor& t : troupe_tensors(m)) {
    TROUPE_ASSIGN_OR_RETURN(std::vector<HfPiece> pieces, hf_pieces(m, config_.family, t, fused_));
    for (const HfPiece& p : pieces) {
      Result<Loc> loc = find(p.hf_name);
      if (!loc.ok()) {
        return not_found("{}: tensor '{}' (for Troupe's {}) is missing", dir_, p.hf_name, t.name);
      }
      const StTensorInfo& info = *loc->info;
      if (info.shape != p.hf_shape) {
        return failed_precondition("{}: tensor '{}' has shape {} but config.json implies {}", dir_, p.hf_name,
                                   shape_to_string(info.shape), shape_to_string(p.hf_shape));
      }
      if (info.dtype != StDType::kF32 && info.dtype != StDType::kBF16 && info.dtype != StDType::kF16) {
        return failed_precondition(
            "{}: tensor '{}' is {}; weights must be F32, BF16 or F16 (quantized checkpoints are "
            "not read: dequantize first)",
            dir_, p.hf_name, info.dtype_name);
      }
      used.insert(p.hf_name);
    }
  }
  std::vector<std::string> extra;
  for (const auto& [name, loc] : tensors_) {
    if (used.count(name) || ignorable(name)) continue;
    // A tied head saved anyway (some hub checkpoints do): transformers ties it to the
    // embedding on load, so does Troupe.
    if (name == "lm_head.weight" && m.tie_embeddings) continue;
    extra.push_back(name);
  }
  if (!extra.empty()) {
    return failed_precondition(
        "{}: {} tensor(s) have no place in Troupe's {} model, e.g. '{}'{}: the checkpoint holds a feature "
        "the import "
        "would drop",
        dir_, extra.size(), family_name(config_.family), extra.front(),
        extra.size() > 1 ? fmt::format(", '{}'", extra[1]) : "");
  }
  return ok_status();
}

Status HfCheckpoint::read(const std::string& name, const Shape& global, const Slice& box, Tensor& dst) const {
  if (!dst.defined() || !dst.device().is_cpu() || !dst.is_contiguous() || dst.dtype() != DType::kF32 ||
      dst.shape() != checkpoint::slice_shape(box)) {
    return invalid_argument(
        "HfCheckpoint::read('{}'): the destination must be a contiguous host f32 tensor of shape {}", name,
        shape_to_string(checkpoint::slice_shape(box)));
  }
  TROUPE_RETURN_IF_ERROR(checkpoint::check_slice_within(box, global, name));
  TROUPE_ASSIGN_OR_RETURN(std::vector<HfPiece> pieces,
                          hf_pieces(config_.model, config_.family, {name, global}, fused_));
  int64_t covered = 0;
  for (const HfPiece& p : pieces) {
    const std::optional<Slice> region = checkpoint::intersect(box, p.box);
    if (!region || checkpoint::slice_numel(*region) == 0) continue;
    TROUPE_ASSIGN_OR_RETURN(Loc loc, find(p.hf_name));
    if (loc.info->shape != p.hf_shape) {
      return failed_precondition("{}: tensor '{}' has shape {}, expected {}", dir_, p.hf_name,
                                 shape_to_string(loc.info->shape), shape_to_string(p.hf_shape));
    }
    TROUPE_ASSIGN_OR_RETURN(DType dt,
                            to_dtype(loc.info->dtype, fmt::format("{}: tensor '{}'", dir_, p.hf_name)));
    if (dt != DType::kF32 && dt != DType::kBF16 && dt != DType::kF16) {
      return failed_precondition("{}: tensor '{}' is {}; weights must be F32, BF16 or F16", dir_, p.hf_name,
                                 loc.info->dtype_name);
    }
    hf_to_troupe(p, loc.file->data(*loc.info), dt, *region, dst.data<float>(), box);
    covered += checkpoint::slice_numel(*region);
    bytes_read_ += static_cast<uint64_t>(checkpoint::slice_numel(*region)) * dtype_size(dt);
  }
  if (covered != checkpoint::slice_numel(box)) {
    return internal_error("HfCheckpoint::read('{}' {}): the {} tensors cover {} of {} elements", name,
                          checkpoint::slice_to_string(box), family_name(config_.family), covered,
                          checkpoint::slice_numel(box));
  }
  return ok_status();
}

Status load_hf_weights(const HfCheckpoint& ckpt, layers::Model& model) {
  TROUPE_RETURN_IF_ERROR(ckpt.validate(model.config()));
  for (auto& p : model.parameters()) {
    Tensor& v = p.param->value;
    if (!v.device().is_cpu() || v.dtype() != DType::kF32) {
      return invalid_argument("load_hf_weights: parameter {} is not an f32 host tensor", p.name);
    }
    TROUPE_RETURN_IF_ERROR(ckpt.read(p.name, v.shape(), checkpoint::full_slice(v.shape()), v));
  }
  for (auto& b : model.buffers()) kernels::fill(kernels::Exec::cpu(), *b.tensor, 0.0f);  // no selection bias
  return ok_status();
}

// ---- export -------------------------------------------------------------------------------

namespace {

// One HF tensor to write: its piece, the Troupe tensor it comes from, where it goes.
struct Target {
  HfPiece piece;
  std::string troupe_name;
  int file = 0;
  uint64_t offset = 0;  // absolute, in its file
};

// Writes the HF region `hf_box` (held densely in `buf`) of a tensor whose full shape is
// `shape` and that starts at byte `base` of the file: one pwrite per contiguous run.
Status write_region(int fd, const std::string& path, uint64_t base, const Shape& shape, const Slice& hf_box,
                    const std::byte* buf, size_t esize) {
  const int r = static_cast<int>(shape.size());
  // Dims [k, r) are whole in the box: with dim k - 1 they make one contiguous run.
  int k = r;
  while (k > 0 && hf_box[static_cast<size_t>(k - 1)].start == 0 &&
         hf_box[static_cast<size_t>(k - 1)].length == shape[static_cast<size_t>(k - 1)])
    --k;
  if (k == 0) {
    return checkpoint::pwrite_all(fd, buf, static_cast<size_t>(shape_numel(shape)) * esize, base, path);
  }
  std::vector<int64_t> stride(static_cast<size_t>(r), 1);
  for (int d = r - 1; d > 0; --d)
    stride[static_cast<size_t>(d - 1)] = stride[static_cast<size_t>(d)] * shape[static_cast<size_t>(d)];
  const Range& part = hf_box[static_cast<size_t>(k - 1)];
  const size_t run = static_cast<size_t>(part.length * stride[static_cast<size_t>(k - 1)]) * esize;
  std::vector<int64_t> idx;  // the odometer over dims [0, k - 1)
  for (int d = 0; d < k - 1; ++d) idx.push_back(hf_box[static_cast<size_t>(d)].start);
  const std::byte* src = buf;
  while (true) {
    int64_t off = part.start * stride[static_cast<size_t>(k - 1)];
    for (int d = 0; d < k - 1; ++d) off += idx[static_cast<size_t>(d)] * stride[static_cast<size_t>(d)];
    TROUPE_RETURN_IF_ERROR(
        checkpoint::pwrite_all(fd, src, run, base + static_cast<uint64_t>(off) * esize, path));
    src += run;
    int d = k - 2;
    for (; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < hf_box[static_cast<size_t>(d)].end()) break;
      idx[static_cast<size_t>(d)] = hf_box[static_cast<size_t>(d)].start;
    }
    if (d < 0) return ok_status();
  }
}

}  // namespace

Result<ExportSummary> export_hf(const checkpoint::CheckpointReader& reader, const layers::ModelConfig& m,
                                const std::string& out_dir, const ExportOptions& o) {
  TROUPE_ASSIGN_OR_RETURN(json config, hf_config_for(m, o.family, o.dtype));
  config["max_position_embeddings"] = o.max_position_embeddings > 0 ? o.max_position_embeddings : 4096;
  config["bos_token_id"] = o.bos_token_id ? json(*o.bos_token_id) : json(nullptr);
  config["eos_token_id"] = o.eos_token_id ? json(*o.eos_token_id) : json(nullptr);
  const StDType st = o.dtype == DType::kBF16 ? StDType::kBF16 : StDType::kF32;
  const size_t esize = st_dtype_size(st);

  // ---- plan: every HF tensor, its file and offset ----------------------------------------
  std::vector<TroupeTensor> tensors = troupe_tensors(m);
  std::vector<Target> targets;
  for (const TroupeTensor& t : tensors) {
    Result<const checkpoint::TensorRecord*> rec = reader.tensor(t.name);
    if (!rec.ok())
      return not_found("checkpoint {} holds no tensor '{}' (not a model of this config?)", reader.path(),
                       t.name);
    if ((*rec)->shape != t.shape || (*rec)->dtype != DType::kF32) {
      return failed_precondition("checkpoint {}: tensor '{}' is {} {}, the model config implies f32 {}",
                                 reader.path(), t.name, dtype_name((*rec)->dtype),
                                 shape_to_string((*rec)->shape), shape_to_string(t.shape));
    }
    TROUPE_ASSIGN_OR_RETURN(std::vector<HfPiece> pieces, hf_pieces(m, o.family, t));
    for (HfPiece& p : pieces) targets.push_back({std::move(p), t.name});
  }
  std::vector<std::vector<SafetensorsLayout::Entry>> file_entries(1);
  uint64_t in_file = 0, total = 0;
  for (Target& t : targets) {
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(t.piece.hf_shape)) * esize;
    if (in_file > 0 && in_file + bytes > o.max_shard_bytes) {
      file_entries.emplace_back();
      in_file = 0;
    }
    t.file = static_cast<int>(file_entries.size()) - 1;
    file_entries.back().push_back({t.piece.hf_name, st, t.piece.hf_shape});
    in_file += bytes;
    total += bytes;
  }
  const int nfiles = static_cast<int>(file_entries.size());
  std::vector<SafetensorsLayout> layouts;
  std::vector<std::string> names, paths;
  for (int f = 0; f < nfiles; ++f) {
    layouts.push_back(SafetensorsLayout::plan(file_entries[static_cast<size_t>(f)], json{{"format", "pt"}}));
    names.push_back(fmt::format("model-{:05d}-of-{:05d}.safetensors", f + 1, nfiles));
  }
  {
    std::map<std::string, const SafetensorsLayout::Entry*> by_name;
    for (const auto& l : layouts)
      for (const auto& e : l.entries) by_name[e.name] = &e;
    for (Target& t : targets) t.offset = by_name.at(t.piece.hf_name)->offset;
  }

  // ---- the files: sized, headers written ----------------------------------------------
  TROUPE_RETURN_IF_ERROR(checkpoint::make_dirs(out_dir));
  std::vector<checkpoint::FileHandle> fds;
  for (int f = 0; f < nfiles; ++f) {
    paths.push_back(out_dir + "/" + names[static_cast<size_t>(f)] + ".tmp");
    TROUPE_ASSIGN_OR_RETURN(checkpoint::FileHandle fh,
                            checkpoint::open_file(paths.back(), O_WRONLY | O_CREAT | O_TRUNC));
    const SafetensorsLayout& l = layouts[static_cast<size_t>(f)];
    if (ftruncate(fh.fd(), static_cast<off_t>(l.file_size)) != 0) {
      return checkpoint::errno_status("ftruncate", paths.back(), errno);
    }
    TROUPE_RETURN_IF_ERROR(
        checkpoint::pwrite_all(fh.fd(), l.header.data(), l.header.size(), 0, paths.back()));
    fds.push_back(std::move(fh));
  }

  // ---- stream: each stored slice once --------------------------------------------------
  struct Job {
    const TroupeTensor* tensor;
    Slice box;
  };
  std::vector<Job> jobs;
  for (const TroupeTensor& t : tensors) {
    const checkpoint::TensorRecord* rec = *reader.tensor(t.name);
    std::vector<Slice> boxes;
    for (const auto& s : rec->slices)
      if (std::find(boxes.begin(), boxes.end(), s.box) == boxes.end()) boxes.push_back(s.box);
    for (Slice& b : boxes) jobs.push_back({&t, std::move(b)});
  }
  std::map<std::string, std::vector<const Target*>> by_tensor;
  for (const Target& t : targets) by_tensor[t.troupe_name].push_back(&t);
  std::map<const Target*, int64_t> covered;  // elements written per HF tensor
  for (const Target& t : targets) covered[&t] = 0;
  std::mutex mu;
  Status failure;
  uint64_t done = 0;
  size_t next = 0;
  const auto worker = [&] {
    std::vector<std::byte> out;
    while (true) {
      size_t j;
      {
        std::lock_guard<std::mutex> l(mu);
        if (!failure.ok() || next == jobs.size()) return;
        j = next++;
      }
      const Job& job = jobs[j];
      Tensor src = Tensor::empty(checkpoint::slice_shape(job.box), DType::kF32);
      Status st = reader.read_into(job.tensor->name, job.box, src);
      uint64_t written = 0;
      std::vector<std::pair<const Target*, int64_t>> cover;
      for (const Target* t : by_tensor[job.tensor->name]) {
        if (!st.ok()) break;
        const std::optional<Slice> region = checkpoint::intersect(job.box, t->piece.box);
        if (!region || checkpoint::slice_numel(*region) == 0) continue;
        const Slice hb = hf_box_of(t->piece, *region);
        const int64_t n = checkpoint::slice_numel(*region);
        out.resize(static_cast<size_t>(n) * esize);
        troupe_to_hf(t->piece, src.data<float>(), job.box, *region, out.data(), o.dtype, hb);
        st = write_region(fds[static_cast<size_t>(t->file)].fd(), paths[static_cast<size_t>(t->file)],
                          t->offset, t->piece.hf_shape, hb, out.data(), esize);
        written += static_cast<uint64_t>(n) * esize;
        cover.emplace_back(t, n);
      }
      std::lock_guard<std::mutex> l(mu);
      if (!st.ok()) {
        if (failure.ok()) failure = st.with_context(fmt::format("export of '{}'", job.tensor->name));
        return;
      }
      for (const auto& [t, n] : cover) covered[t] += n;
      done += written;
      if (o.progress) o.progress(done, total);
    }
  };
  const int threads = std::max(1, std::min<int>(o.threads, static_cast<int>(jobs.size())));
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (!failure.ok()) return failure;
  for (const auto& [t, n] : covered) {
    if (n != shape_numel(t->piece.hf_shape)) {
      return data_loss("checkpoint {}: '{}' covers {} of the {} elements of {}", reader.path(),
                       t->troupe_name, n, shape_numel(t->piece.hf_shape), t->piece.hf_name);
    }
  }

  // ---- commit: fsync, rename, index, config last ---------------------------------------
  for (int f = 0; f < nfiles; ++f) {
    TROUPE_RETURN_IF_ERROR(
        checkpoint::fsync_fd(fds[static_cast<size_t>(f)].fd(), paths[static_cast<size_t>(f)]));
    const std::string final_path = out_dir + "/" + names[static_cast<size_t>(f)];
    std::error_code ec;
    fs::rename(paths[static_cast<size_t>(f)], final_path, ec);
    if (ec)
      return io_error("cannot rename {} to {}: {}", paths[static_cast<size_t>(f)], final_path, ec.message());
  }
  // Files of an earlier export with more shards would make the directory ambiguous.
  for (const auto& e : fs::directory_iterator(out_dir)) {
    const std::string n = e.path().filename().string();
    if (n.ends_with(".safetensors") && std::find(names.begin(), names.end(), n) == names.end()) {
      std::error_code ec;
      fs::remove(e.path(), ec);
    }
  }
  json index;
  index["metadata"] = {{"total_size", total}, {"total_parameters", total / esize}};
  json wm = json::object();
  for (const Target& t : targets) wm[t.piece.hf_name] = names[static_cast<size_t>(t.file)];
  index["weight_map"] = wm;
  TROUPE_RETURN_IF_ERROR(
      checkpoint::write_file_durably(out_dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
  json gen{{"_from_model_config", true}};
  if (o.bos_token_id) gen["bos_token_id"] = *o.bos_token_id;
  if (o.eos_token_id) gen["eos_token_id"] = *o.eos_token_id;
  TROUPE_RETURN_IF_ERROR(
      checkpoint::write_file_durably(out_dir + "/generation_config.json", gen.dump(2) + "\n"));
  TROUPE_RETURN_IF_ERROR(checkpoint::write_file_durably(out_dir + "/config.json", config.dump(2) + "\n"));
  ExportSummary s;
  s.tensors = static_cast<int64_t>(targets.size());
  s.files = nfiles;
  s.bytes = total;
  return s;
}

}  // namespace troupe::interop
