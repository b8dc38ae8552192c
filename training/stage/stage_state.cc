// training/stage/stage_state.cc — Stage's state as named global slices: export (for a
// checkpoint or a peer), import (from any saved layout), and the slice sources reading a
// checkpoint or exported states. See stage_state.h for the names and placements.
#include "training/stage/stage_state.h"

#include <fmt/format.h>

#include <cstring>

#include "checkpoint/reader.h"
#include "interop/hf_checkpoint.h"
#include "training/stage/stage.h"

namespace troupe::training {

using checkpoint::Slice;
using checkpoint::TensorPlacement;

std::string opt_m_name(const std::string& param) { return "opt.m." + param; }
std::string opt_v_name(const std::string& param) { return "opt.v." + param; }

// One tensor this rank holds: `local` holds owned_slice(name, global, placement) of the
// current layout. `savable` is false for a copy whose global tensor another stage saves
// (the embedding tied into the last stage's head).
struct Stage::StateTensor {
  std::string name;
  Shape global;
  TensorPlacement placement;
  Tensor local;
  bool savable = true;
};

ParallelLayout Stage::state_layout() const {
  return *layout_;
}

int64_t Stage::steps_done() const { return opt_->steps_done(); }

Result<std::vector<Stage::StateTensor>> Stage::state_tensors() const {
  std::vector<StateTensor> out;
  const int stage = coord_.pp;
  const int64_t n = layout_->n();
  // Parameters, in entries_ order (the flat buffer's order).
  struct Global {
    std::string name;
    Shape shape;
    bool savable;
  };
  std::vector<Global> globals;
  for (const Entry& e : entries_) {
    // "...w1[local]" is this rank's block of experts, "embedding.weight[tied copy]" the
    // last stage's copy of the embedding: both are slices of the bare global name. An
    // n-sharded parameter is dim 0's block of a global n times as large.
    const size_t br = e.name.find('[');
    Global g{e.name.substr(0, br), e.param->value.shape(), true};
    if (e.expert) g.shape[0] *= n;
    if (br != std::string::npos && e.name.compare(br, std::string::npos, "[tied copy]") == 0) g.savable = false;
    out.push_back({g.name, g.shape, e.expert ? TensorPlacement::experts(stage) : TensorPlacement::replicated(stage),
                   e.param->value, g.savable});
    globals.push_back(std::move(g));
  }
  // The program's buffers, e.g. router biases (replicated over dp and n).
  for (const ProgramBuffer& b : program_->buffers()) {
    out.push_back({b.name, b.tensor->shape(), TensorPlacement::replicated(stage), *b.tensor, true});
  }
  // AdamW moments of this rank's ZeRO-1 shard: one piece per parameter overlapping it,
  // in the order setup_params made them (AdamW::state() gives m, v per piece).
  std::vector<layers::NamedBuffer> moments = opt_->state();
  size_t piece = 0;
  for (size_t k = 0; k < entries_.size(); ++k) {
    const Entry& e = entries_[k];
    const int64_t a = std::max(e.offset, shard_lo_);
    const int64_t b = std::min(e.offset + e.param->numel(), shard_lo_ + shard_len_);
    if (a >= b) continue;
    if (2 * piece + 1 >= moments.size()) return internal_error("stage state: optimizer holds fewer pieces than the shard");
    const Global& g = globals[k];
    const Shape flat{shape_numel(g.shape)};
    const TensorPlacement p = TensorPlacement::zero(stage, e.expert, e.offset, flat_size_);
    out.push_back({opt_m_name(g.name), flat, p, *moments[2 * piece].tensor, g.savable});
    out.push_back({opt_v_name(g.name), flat, p, *moments[2 * piece + 1].tensor, g.savable});
    ++piece;
  }
  if (2 * piece != moments.size()) return internal_error("stage state: optimizer holds more pieces than the shard");
  return out;
}

Result<StageState> Stage::export_state(StateScope scope, bool copy) const {
  const_cast<Stage*>(this)->settle();  // the parameter all-gather of the last step (overlap)
  StageState st;
  st.step = steps_done();
  st.layout = state_layout();
  st.rank = rank_;
  st.coords = coord_;
  TROUPE_ASSIGN_OR_RETURN(std::vector<StateTensor> tensors, state_tensors());
  for (const StateTensor& t : tensors) {
    if (scope == StateScope::kSave && !t.savable) continue;
    Result<std::optional<Slice>> box =
        scope == StateScope::kSave ? checkpoint::save_slice(t.name, t.global, t.placement, st.layout, st.coords)
                                   : checkpoint::owned_slice(t.name, t.global, t.placement, st.layout, st.coords);
    if (!box.ok()) return box.status();
    if (!box->has_value()) continue;
    const Slice& s = **box;
    if (checkpoint::slice_numel(s) != t.local.numel()) {
      return internal_error("stage state: '{}' holds {} elements but its slice {} has {}", t.name, t.local.numel(),
                            checkpoint::slice_to_string(s), checkpoint::slice_numel(s));
    }
    checkpoint::SaveEntry e;
    e.name = t.name;
    e.global_shape = t.global;
    for (const auto& r : s) e.offsets.push_back(r.start);
    const Tensor view = t.local.view(checkpoint::slice_shape(s));
    // A device Stage's buffers live on the GPU: always a host copy (to_host waits for the
    // stream, so the copy is the state after the last step).
    e.tensor = ctx_.on_device() ? ctx_.to_host(view) : copy ? view.clone() : view;
    st.slices.push_back(std::move(e));
  }
  st.rank_state = rank_state();
  return st;
}

nlohmann::json Stage::rank_state() const {
  const int64_t steps = steps_done();
  return nlohmann::json{
      {"step", steps},
      {"adam_steps", steps},
      {"data",
       {{"next_step", steps + 1},
        {"seed", tc_.train.seed},
        {"dp_rank", coord_.dp},
        {"micro_batch_size", tc_.train.micro_batch_size},
        {"grad_accum", tc_.train.grad_accum}}},
      // No stateful generator exists: initialisation and data order are counter-based
      // functions of the seed and the step.
      {"rng", {{"kind", "counter-based (splitmix64 of seed, name, index)"}, {"seed", tc_.train.seed}}}};
}

Result<std::vector<Stage::SnapshotTensor>> Stage::snapshot_tensors() const {
  const_cast<Stage*>(this)->settle();  // the parameter all-gather of the last step (overlap)
  TROUPE_ASSIGN_OR_RETURN(std::vector<StateTensor> tensors, state_tensors());
  const ParallelLayout layout = state_layout();
  std::vector<SnapshotTensor> saved, held;
  for (const StateTensor& t : tensors) {
    TROUPE_ASSIGN_OR_RETURN(std::optional<checkpoint::Slice> own,
                            checkpoint::owned_slice(t.name, t.global, t.placement, layout, coord_));
    if (!own) continue;
    std::optional<checkpoint::Slice> save;
    if (t.savable) {
      TROUPE_ASSIGN_OR_RETURN(save, checkpoint::save_slice(t.name, t.global, t.placement, layout, coord_));
    }
    // What a checkpoint saves from this rank is all of what it holds of a tensor, or none.
    if (save && *save != *own) {
      return internal_error("snapshot: '{}' saves {} of the {} this rank holds", t.name,
                            checkpoint::slice_to_string(*save), checkpoint::slice_to_string(*own));
    }
    if (checkpoint::slice_numel(*own) != t.local.numel() || !t.local.is_contiguous()) {
      return internal_error("snapshot: '{}' holds {} elements (contiguous: {}) but owns slice {}", t.name,
                            t.local.numel(), t.local.is_contiguous(), checkpoint::slice_to_string(*own));
    }
    SnapshotTensor s;
    s.entry.name = t.name;
    s.entry.global_shape = t.global;
    for (const auto& r : *own) s.entry.offsets.push_back(r.start);
    s.entry.tensor = t.local.view(checkpoint::slice_shape(*own));
    s.saved = save.has_value();
    (s.saved ? saved : held).push_back(std::move(s));
  }
  saved.insert(saved.end(), std::make_move_iterator(held.begin()), std::make_move_iterator(held.end()));
  return saved;
}

Status Stage::import_state(const SliceSource& source, int64_t steps_done) {
  if (steps_done < 0) return invalid_argument("import_state: steps_done {} < 0", steps_done);
  settle();  // nothing may still write the parameters
  const ParallelLayout layout = state_layout();
  const ParallelCoord coords = coord_;
  TROUPE_ASSIGN_OR_RETURN(std::vector<StateTensor> tensors, state_tensors());
  for (StateTensor& t : tensors) {
    TROUPE_ASSIGN_OR_RETURN(std::optional<Slice> box, checkpoint::owned_slice(t.name, t.global, t.placement, layout, coords));
    if (!box) continue;
    if (checkpoint::slice_numel(*box) != t.local.numel() || !t.local.is_contiguous()) {
      return internal_error("stage state: '{}' holds {} elements (contiguous: {}) but owns slice {}", t.name,
                            t.local.numel(), t.local.is_contiguous(), checkpoint::slice_to_string(*box));
    }
    // The live buffer itself (a view into the flat value buffer, a moment, a bias); on a
    // device, a host buffer copied up afterwards.
    Tensor dst = t.local.view(checkpoint::slice_shape(*box));
    Tensor host = ctx_.on_device() ? Tensor::empty(dst.shape(), dst.dtype()) : dst;
    Status st = source(t.name, t.global, *box, host);
    if (!st.ok()) return st.with_context(fmt::format("rank {} ({} of layout {})", rank_, coords.to_string(), layout.to_string()));
    if (ctx_.on_device()) {
      ctx_.copy_to_device(host, dst);
      synchronize();  // `host` is freed at the end of this iteration
    }
  }
  refresh_working_copies();  // the copies the kernels read (and split halves) from the imported values
  opt_->set_steps_done(steps_done);
  return ok_status();
}

Status Stage::load_checkpoint(const checkpoint::CheckpointReader& reader) {
  const int64_t steps = reader.manifest().metadata.value("adam_steps", reader.step());
  return import_state(slice_source(reader), steps);
}

SliceSource slice_source(const checkpoint::CheckpointReader& reader) {
  return [&reader](const std::string& name, const Shape& global, const Slice& box, Tensor& dst) -> Status {
    Result<const checkpoint::TensorRecord*> rec = reader.tensor(name);
    if (!rec.ok()) {
      return not_found("checkpoint {} holds no tensor '{}' (saved by a different model?)", reader.path(), name);
    }
    if ((*rec)->shape != global) {
      return failed_precondition("checkpoint {}: tensor '{}' has shape {} but this model's is {} (model config "
                                 "differs from the saved run)",
                                 reader.path(), name, shape_to_string((*rec)->shape), shape_to_string(global));
    }
    if ((*rec)->dtype != dst.dtype()) {
      return failed_precondition("checkpoint {}: tensor '{}' is {} but training holds {}", reader.path(), name,
                                 dtype_name((*rec)->dtype), dtype_name(dst.dtype()));
    }
    return reader.read_into(name, box, dst);
  };
}

SliceSource slice_source(const interop::HfCheckpoint& ckpt) {
  return [&ckpt](const std::string& name, const Shape& global, const Slice& box, Tensor& dst) -> Status {
    const bool moment = name.rfind("opt.m.", 0) == 0 || name.rfind("opt.v.", 0) == 0;
    const bool bias = name.size() > 12 && name.compare(name.size() - 12, 12, ".router.bias") == 0;
    if (moment || bias) {  // a fresh run's: zero
      std::memset(dst.data_ptr(), 0, dst.nbytes());
      return ok_status();
    }
    return ckpt.read(name, global, box, dst);
  };
}

Status init_from_hf(Stage& stage, const layers::TrainConfig& tc) {
  if (tc.train.init_from.empty()) return ok_status();
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<interop::HfCheckpoint> ckpt,
                          interop::HfCheckpoint::open(tc.train.init_from));
  TROUPE_RETURN_IF_ERROR(ckpt->validate(tc.model).with_context("train.init_from"));
  TROUPE_RETURN_IF_ERROR(stage.import_state(slice_source(*ckpt), 0).with_context("train.init_from"));
  fmt::print("rank {}: initialised from {} ({}): read {:.2f} MB of its slices\n", stage.rank(),
             tc.train.init_from, interop::family_name(ckpt->config().family),
             static_cast<double>(ckpt->bytes_read()) / 1e6);
  std::fflush(stdout);
  return ok_status();
}

SliceSource slice_source(const std::vector<const StageState*>& states) {
  return [states](const std::string& name, const Shape& global, const Slice& box, Tensor& dst) -> Status {
    const int64_t numel = checkpoint::slice_numel(box);
    const size_t esz = dst.element_size();
    // Coverage mask: a byte per element of `box`, set by copying regions of ones, so
    // that several states holding the same replica count once.
    std::vector<uint8_t> covered(static_cast<size_t>(numel), 0);
    for (const StageState* s : states) {
      for (const checkpoint::SaveEntry& e : s->slices) {
        if (e.name != name) continue;
        if (e.global_shape != global) {
          return failed_precondition("state of rank {}: tensor '{}' has shape {}, expected {}", s->rank, name,
                                     shape_to_string(e.global_shape), shape_to_string(global));
        }
        Slice sbox;
        for (size_t d = 0; d < global.size(); ++d) {
          sbox.push_back({e.offsets.empty() ? 0 : e.offsets[d], e.tensor.shape()[d]});
        }
        const std::optional<Slice> inter = checkpoint::intersect(box, sbox);
        if (!inter) continue;
        const Tensor src = e.tensor.contiguous();
        checkpoint::copy_region(static_cast<const std::byte*>(src.data_ptr()), sbox,
                                static_cast<std::byte*>(dst.data_ptr()), box, *inter, esz);
        const std::vector<std::byte> ones(static_cast<size_t>(e.tensor.numel()), std::byte{1});
        checkpoint::copy_region(ones.data(), sbox, reinterpret_cast<std::byte*>(covered.data()), box, *inter, 1);
      }
    }
    for (int64_t i = 0; i < numel; ++i) {
      if (covered[static_cast<size_t>(i)] == 0) {
        return not_found("tensor '{}' slice {}: element {} of the box is held by none of the {} states given", name,
                         checkpoint::slice_to_string(box), i, states.size());
      }
    }
    return ok_status();
  };
}

}  // namespace troupe::training
