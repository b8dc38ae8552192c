// actors/training/stage_elastic.cc — the Stage's elastic-recovery members (stage.h,
// "elastic recovery"): communicators that can be aborted and rebuilt in a new epoch, the
// replicated optimizer moments, the committed state a survivor rolls back to, and the
// state broadcast that restores a replacement (or a new dp rank) from a peer's memory,
// and commit_imported (after Stage::import_state from a checkpoint, stage_state.cc).
//
// Why it is exact: the flat parameter layout (entries and offsets) depends only on the
// (pp, n) coordinates, so every dp rank of a column holds the same values, and after
// replicate_optimizer() the same moments of the whole column. Broadcasting them from any
// survivor of the column reproduces the lost rank's state bit for bit; ZeRO-1 shards are
// then cut from the full moments for the (possibly new) dp size.
//
// On a GPU the committed state stays in device memory (copies on the compute stream, the
// dp collectives over NCCL on it too); the Stage's bf16 working copies are refreshed after
// every restore. The neighbour replicas are host-side and CPU-only (the Trainer turns them
// off for GPU workers).
#include <fmt/format.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "actors/training/stage.h"
#include "core/check.h"

namespace troupe::training {

// ---- where the state lives -------------------------------------------------------------

Tensor Stage::state_zeros(int64_t n, DType dtype) const {
  return ctx_.on_device() ? ctx_.zeros({n}, dtype) : Tensor::zeros({n}, dtype);
}

Tensor Stage::state_clone(const Tensor& t) const {
  if (t.device().is_cpu()) return t.clone();
  Tensor c = ctx_.empty(t.shape(), t.dtype());
  kernels::cast(ctx_.ex, t, c);
  return c;
}

void Stage::state_copy(const Tensor& src, Tensor dst) const {
  TROUPE_CHECK(src.device().is_cpu() == dst.device().is_cpu(), "state_copy: {} -> {} crosses devices",
               src.describe(), dst.describe());
  if (dst.device().is_cpu()) {
    dst.copy_from(src);
  } else {
    kernels::cast(ctx_.ex, src, dst);
  }
}

void Stage::after_restore() {
  refresh_working_copies();  // the copies the kernels read (and split halves) from the restored values
}

comm::CommFactory Stage::elastic_factory(comm::CommFactory inner) {
  return [this, inner = std::move(inner)](const comm::CommSpec& spec) -> Result<std::unique_ptr<comm::Communicator>> {
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<ElasticComm> c, ElasticComm::create(spec, inner));
    elastic_comms_.push_back(c.get());
    return std::unique_ptr<comm::Communicator>(std::move(c));
  };
}

void Stage::abort_comms(std::string_view reason) {
  if (!ctx_.on_device() || elastic_comms_.size() <= 1) {
    for (ElasticComm* c : elastic_comms_) c->abort(reason);
    return;
  }
  // On a GPU every communicator is aborted at once, one thread each: an NCCL abort frees
  // device memory, which waits for the device's queued work — and a kernel of a
  // communicator not yet aborted (e.g. the world's all-reduce queued behind the dp
  // reduce-scatter that waited for the dead peer) would then wait for that peer forever.
  std::vector<std::thread> aborts;
  aborts.reserve(elastic_comms_.size());
  for (ElasticComm* c : elastic_comms_) aborts.emplace_back([c, r = std::string(reason)] { c->abort(r); });
  for (std::thread& t : aborts) t.join();
}

Status Stage::rebuild_comms(const comm::StoreNamespace& ns) {
  // A captured step holds the old communicators' handles: the next step captures anew.
  if (graph_ && layout_->world_size() > 1) graph_->reset();
  for (ElasticComm* c : elastic_comms_) {
    TROUPE_RETURN_IF_ERROR(c->rebuild(ns).with_context(fmt::format("rebuilding communicator {}", c->spec().name)));
  }
  return ok_status();
}

std::vector<int64_t> Stage::piece_offsets() const {
  // The same walk as setup_params: a piece is the overlap of an entry with the shard.
  std::vector<int64_t> out;
  for (const auto& e : entries_) {
    const int64_t a = std::max(e.offset, shard_lo_);
    const int64_t b = std::min(e.offset + e.param->numel(), shard_lo_ + shard_len_);
    if (a < b) out.push_back(a);
  }
  return out;
}

std::vector<Tensor*> Stage::buffer_tensors() {
  std::vector<Tensor*> out;
  for (const ProgramBuffer& b : program_->buffers()) out.push_back(b.tensor);
  return out;
}

void Stage::moments_to_pieces(const Tensor& full_m, const Tensor& full_v) {
  const std::vector<int64_t> offs = piece_offsets();
  std::vector<layers::NamedBuffer> st = opt_->state();  // m, v per piece, in piece order
  TROUPE_CHECK_EQ(st.size(), 2 * offs.size());
  for (size_t i = 0; i < offs.size(); ++i) {
    Tensor& m = *st[2 * i].tensor;
    Tensor& v = *st[2 * i + 1].tensor;
    state_copy(full_m.narrow(0, offs[i], m.numel()).view(m.shape()), m);
    state_copy(full_v.narrow(0, offs[i], v.numel()).view(v.shape()), v);
  }
}

void Stage::replicate_optimizer() {
  const int64_t padded = buf_.values().numel();
  Tensor shard_m = state_zeros(shard_len_), shard_v = state_zeros(shard_len_);
  const std::vector<int64_t> offs = piece_offsets();
  std::vector<layers::NamedBuffer> st = opt_->state();
  for (size_t i = 0; i < offs.size(); ++i) {
    const Tensor& m = *st[2 * i].tensor;
    const Tensor& v = *st[2 * i + 1].tensor;
    state_copy(m.view({m.numel()}), shard_m.narrow(0, offs[i] - shard_lo_, m.numel()));
    state_copy(v.view({v.numel()}), shard_v.narrow(0, offs[i] - shard_lo_, v.numel()));
  }
  Tensor fm = state_zeros(padded), fv = state_zeros(padded);
  all_gather(*groups_.dp, shard_m, fm, time_, "elastic moments replica all_gather (dp)");
  all_gather(*groups_.dp, shard_v, fv, time_, "elastic moments replica all_gather (dp)");
  // On a GPU the gathers are in flight on the stream: a failure must surface here, before
  // a half-gathered copy could be committed.
  if (ctx_.on_device()) time_.drain("elastic moments replica all_gather (dp)");
  full_m_ = fm;  // replaced only once both arrived
  full_v_ = fv;
}

void Stage::commit(int64_t step_done) {
  if (!full_m_.defined()) {
    full_m_ = state_zeros(buf_.values().numel());
    full_v_ = state_zeros(buf_.values().numel());
  }
  if (committed_[0].step == step_done) return;  // already recorded (e.g. after an evaluation)
  settle();                                     // no step in flight; split masters' values joined
  committed_[1] = std::move(committed_[0]);
  Committed& c = committed_[0];
  c.step = step_done;
  c.value = state_clone(buf_.values());
  c.m = full_m_;  // never written in place (replicate_optimizer makes new tensors)
  c.v = full_v_;
  c.bias.clear();
  for (Tensor* b : buffer_tensors()) c.bias.push_back(state_clone(*b));
  c.opt_steps = opt_->steps_done();
}

std::vector<int64_t> Stage::committed_steps() const {
  return {committed_[0].step, committed_[1].step};
}

void Stage::clear_interrupted_step() {
  // An interrupted step: its sends completed (aborted) when the communicators were
  // aborted; what the program accumulated (e.g. expert loads) must not reach the next step,
  // nor may a step launched behind it.
  pending_sends_.clear();
  launched_.clear();
  first_marked_step_ = -1;  // the next step's gap to a step before the failure means nothing
  if (graph_ && graph_->capturing()) {
    (void)graph_->end_capture();  // a step interrupted while captured: nothing to keep
    graph_->reset();
  }
  program_->discard_step();
}

Status Stage::rollback(int64_t step_done) {
  const Committed* c = nullptr;
  for (const auto& k : committed_) {
    if (k.step == step_done) c = &k;
  }
  if (c == nullptr) {
    return failed_precondition("rank {}: no committed state after step {} (have {} and {})", rank_, step_done,
                               committed_[0].step, committed_[1].step);
  }
  clear_interrupted_step();
  state_copy(c->value, buf_.values());
  full_m_ = c->m;
  full_v_ = c->v;
  moments_to_pieces(full_m_, full_v_);
  std::vector<Tensor*> bs = buffer_tensors();
  for (size_t i = 0; i < bs.size(); ++i) state_copy(c->bias[i], *bs[i]);
  opt_->set_steps_done(c->opt_steps);
  const Committed keep = *c;
  committed_[0] = keep;
  committed_[1] = Committed{};
  after_restore();
  return ok_status();
}

Status Stage::import_state(Stage& old) {
  if (old.flat_size_ != flat_size_ || old.entries_.size() != entries_.size()) {
    return failed_precondition("import_state: rank {} and the old stage have different parameter layouts", rank_);
  }
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].name != old.entries_[i].name || entries_[i].offset != old.entries_[i].offset) {
      return failed_precondition("import_state: entry {} is {} here but {} in the old stage", i, entries_[i].name,
                                 old.entries_[i].name);
    }
  }
  const Committed& c = old.committed_[0];
  if (c.step < 0) return failed_precondition("import_state: the old stage has no committed state");
  state_copy(c.value.narrow(0, 0, flat_size_), buf_.values().narrow(0, 0, flat_size_));
  full_m_ = state_zeros(buf_.values().numel());
  full_v_ = state_zeros(buf_.values().numel());
  state_copy(c.m.narrow(0, 0, flat_size_), full_m_.narrow(0, 0, flat_size_));
  state_copy(c.v.narrow(0, 0, flat_size_), full_v_.narrow(0, 0, flat_size_));
  moments_to_pieces(full_m_, full_v_);
  std::vector<Tensor*> bs = buffer_tensors();
  if (bs.size() != c.bias.size()) return failed_precondition("import_state: router bias count differs");
  for (size_t i = 0; i < bs.size(); ++i) state_copy(c.bias[i], *bs[i]);
  opt_->set_steps_done(c.opt_steps);
  committed_[0] = Committed{};
  committed_[1] = Committed{};
  commit(c.step);
  after_restore();
  return ok_status();
}

void Stage::sync_state(int source_dp, int64_t step_done) {
  if (!full_m_.defined()) {
    full_m_ = state_zeros(buf_.values().numel());
    full_v_ = state_zeros(buf_.values().numel());
  }
  if (layout_->dp() > 1) {
    comm::Communicator& g = *groups_.dp;
    const char* what = "elastic state broadcast (dp)";
    // On a GPU the broadcasts run on the compute stream (after the copies that fill them);
    // each is waited for, so the next restore step sees its data.
    const comm::OpOptions o = time_.op_options();
    time_.wait(g.broadcast(buf_.values().narrow(0, 0, flat_size_), source_dp, o), what);
    // Fresh tensors: the committed copies share the old ones.
    Tensor fm = state_clone(full_m_), fv = state_clone(full_v_);
    time_.wait(g.broadcast(fm.narrow(0, 0, flat_size_), source_dp, o), what);
    time_.wait(g.broadcast(fv.narrow(0, 0, flat_size_), source_dp, o), what);
    full_m_ = fm;
    full_v_ = fv;
    std::vector<Tensor*> bs = buffer_tensors();
    for (Tensor* b : bs) time_.wait(g.broadcast(*b, source_dp, o), what);
    Tensor steps = Tensor::zeros({1}, DType::kI64);
    steps.data<int64_t>()[0] = opt_->steps_done();
    if (ctx_.on_device()) steps = ctx_.to_device(steps);  // NCCL moves device memory only
    time_.wait(g.broadcast(steps, source_dp, o), what);
    opt_->set_steps_done(ctx_.to_host(steps).data<int64_t>()[0]);
  }
  moments_to_pieces(full_m_, full_v_);
  committed_[0] = Committed{};
  committed_[1] = Committed{};
  commit(step_done);
  after_restore();
}

void Stage::commit_imported(int64_t step_done) {
  clear_interrupted_step();
  // import_state wrote this rank's ZeRO-1 pieces of the moments; the column's full
  // moments (what a lost dp peer is restored from) come from every dp rank's pieces.
  replicate_optimizer();
  committed_[0] = Committed{};
  committed_[1] = Committed{};
  commit(step_done);
}

std::map<std::string, int64_t> Stage::params_by_role() const {
  std::map<std::string, int64_t> out{{"stage", 0}, {"attention", 0}, {"experts", 0}};
  for (const Entry& e : entries_) {
    const int64_t n = e.param->numel();
    out["stage"] += n;
    if (!e.role.empty()) out[e.role] += n;
  }
  return out;
}

// ---- neighbour replicas ----------------------------------------------------------------

void Stage::refresh_replica() {
  const Committed& c = committed_[0];
  TROUPE_CHECK(c.step >= 0);  // refresh_replica follows a commit
  comm::Communicator& w = *world_;
  const int size = w.size(), me = w.rank();
  if (size < 2) return;
  const int next = (me + 1) % size, prev = (me + size - 1) % size;
  const char* what = "neighbour replica (world)";
  // The header first: [step, opt_steps, value, m, v, #biases, bias numels...], what the
  // successor needs to allocate (the predecessor holds another coordinate's tensors).
  std::vector<int64_t> hv{c.step,      c.opt_steps, c.value.numel(),
                          c.m.numel(), c.v.numel(), static_cast<int64_t>(c.bias.size())};
  for (const Tensor& b : c.bias) hv.push_back(b.numel());
  Tensor my_header = Tensor::zeros({static_cast<int64_t>(hv.size())}, DType::kI64);
  std::copy(hv.begin(), hv.end(), my_header.data<int64_t>());
  Tensor n_mine = Tensor::zeros({1}, DType::kI64), n_prev = Tensor::zeros({1}, DType::kI64);
  n_mine.data<int64_t>()[0] = my_header.numel();
  {
    comm::WorkPtr s = w.send(n_mine, next);
    comm::WorkPtr r = w.recv(n_prev, prev);
    time_.wait(std::move(s), what);
    time_.wait(std::move(r), what);
  }
  Tensor prev_header = Tensor::zeros({n_prev.data<int64_t>()[0]}, DType::kI64);
  {
    comm::WorkPtr s = w.send(my_header, next);
    comm::WorkPtr r = w.recv(prev_header, prev);
    time_.wait(std::move(s), what);
    time_.wait(std::move(r), what);
  }
  const int64_t* h = prev_header.data<int64_t>();
  Committed held;
  held.step = h[0];
  held.opt_steps = h[1];
  held.value = Tensor::zeros({h[2]}, DType::kF32);
  held.m = Tensor::zeros({h[3]}, DType::kF32);
  held.v = Tensor::zeros({h[4]}, DType::kF32);
  for (int64_t i = 0; i < h[5]; ++i) held.bias.push_back(Tensor::zeros({h[6 + i]}, DType::kF32));
  // The payload: values, moments and router biases (contiguous host copies on the way out).
  std::vector<Tensor> out{c.value.contiguous(), c.m.contiguous(), c.v.contiguous()};
  for (const Tensor& b : c.bias) out.push_back(b.contiguous().view({b.numel()}));
  std::vector<Tensor> in{held.value, held.m, held.v};
  for (const Tensor& b : held.bias) in.push_back(b);
  std::vector<comm::WorkPtr> works;
  for (const Tensor& t : out) works.push_back(w.send(t, next));
  for (const Tensor& t : in) works.push_back(w.recv(t, prev));
  for (auto& wk : works) time_.wait(std::move(wk), what);
  // Replaced only once everything arrived.
  own_replica_[1] = std::move(own_replica_[0]);
  own_replica_[0] = c;  // the committed tensors are never written in place
  held_replica_[1] = std::move(held_replica_[0]);
  held_replica_[0] = std::move(held);
}

void Stage::install(const Committed& c) {
  clear_interrupted_step();
  state_copy(c.value, buf_.values());
  full_m_ = state_clone(c.m);
  full_v_ = state_clone(c.v);
  moments_to_pieces(full_m_, full_v_);
  std::vector<Tensor*> bs = buffer_tensors();
  TROUPE_CHECK_EQ(bs.size(), c.bias.size());
  for (size_t i = 0; i < bs.size(); ++i) state_copy(c.bias[i].view(bs[i]->shape()), *bs[i]);
  opt_->set_steps_done(c.opt_steps);
  committed_[0] = Committed{};
  committed_[1] = Committed{};
  commit(c.step);
  after_restore();
}

Status Stage::restore_from_replicas(const std::vector<bool>& has_state, int64_t step) {
  comm::Communicator& w = *world_;
  const int size = w.size(), me = w.rank();
  if (static_cast<int>(has_state.size()) != size) {
    return failed_precondition("restore_from_replicas: {} ranks in the plan, {} in the world",
                               has_state.size(), size);
  }
  auto find = [step](const Committed(&gens)[2]) -> const Committed* {
    for (const Committed& c : gens) {
      if (c.step == step) return &c;
    }
    return nullptr;
  };
  const char* what = "neighbour replica restore (world)";
  const int prev = (me + size - 1) % size, next = (me + 1) % size;
  // The copy this rank holds goes back to its predecessor when that one was lost.
  std::vector<Tensor> keep_alive;
  std::vector<comm::WorkPtr> works;
  if (!has_state[static_cast<size_t>(prev)]) {
    const Committed* held = find(held_replica_);
    if (held == nullptr) {
      return failed_precondition("rank {} holds no copy of rank {}'s state after step {}", me, prev, step);
    }
    Tensor steps = Tensor::zeros({1}, DType::kI64);
    steps.data<int64_t>()[0] = held->opt_steps;
    keep_alive = {steps, held->value.contiguous(), held->m.contiguous(), held->v.contiguous()};
    for (const Tensor& b : held->bias) keep_alive.push_back(b.contiguous().view({b.numel()}));
    for (const Tensor& t : keep_alive) works.push_back(w.send(t, prev));
  }
  Committed mine;
  Tensor opt_steps = Tensor::zeros({1}, DType::kI64);
  if (has_state[static_cast<size_t>(me)]) {
    const Committed* own = find(own_replica_);
    if (own == nullptr)
      return failed_precondition("rank {} keeps no copy of its own state after step {}", me, step);
    mine = *own;
  } else {
    // A replacement: the same (pp, n) coordinate as the lost rank, so the same sizes.
    mine.step = step;
    mine.value = Tensor::zeros({buf_.values().numel()}, DType::kF32);
    mine.m = Tensor::zeros({buf_.values().numel()}, DType::kF32);
    mine.v = Tensor::zeros({buf_.values().numel()}, DType::kF32);
    for (Tensor* b : buffer_tensors()) mine.bias.push_back(Tensor::zeros({b->numel()}, DType::kF32));
    std::vector<Tensor> in{opt_steps, mine.value, mine.m, mine.v};
    for (const Tensor& b : mine.bias) in.push_back(b);
    for (const Tensor& t : in) works.push_back(w.recv(t, next));
  }
  for (auto& wk : works) time_.wait(std::move(wk), what);
  if (!has_state[static_cast<size_t>(me)]) mine.opt_steps = opt_steps.data<int64_t>()[0];
  install(mine);
  // Every copy describes the old membership's neighbours only in part now: the next
  // refresh rebuilds them.
  for (auto* gens : {&own_replica_, &held_replica_}) {
    (*gens)[0] = Committed{};
    (*gens)[1] = Committed{};
  }
  return ok_status();
}

}  // namespace troupe::training
