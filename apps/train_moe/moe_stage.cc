// apps/train_moe/moe_stage.cc — train_moe's stage program: the blocks [lo, hi) of the MoE
// model that pipeline stage coord.pp runs, each with an AttentionShard and, for MoE
// blocks, an ExpertGroup when n > 1.
//
// A rank creates only its part of the model: the embedding where it is used (the first
// stage, and the last one's copy when the head is tied), its stage's blocks, of each MoE
// block only its experts of the n-group, and the head on the last stage. Every value is
// drawn from (seed, global name, slice) (layers/parameter.h: init_normal_rows for the
// experts), so each part equals that part of the whole model of one process bitwise, and
// a rank's memory holds its part only.
#include "apps/train_moe/moe_stage.h"

#include <fmt/format.h>

#include "layers/block.h"
#include "layers/residual.h"
#include "training/moe/expert_group.h"
#include "training/parallel/attention_shard.h"

namespace troupe::train_moe {
namespace {

using training::AttentionShard;
using training::ExpertGroup;

class MoeStage final : public training::StageProgram {
 public:
  explicit MoeStage(const training::StageEnv& env)
      : tc_(env.tc),
        ctx_(env.ctx),
        first_(env.first),
        last_(env.last),
        n_rank_(env.coord.n),
        batch_(env.batch),
        seq_local_(env.seq_local),
        loss_weight_(env.loss_weight) {
    const auto& par = tc_.parallel;
    const layers::ModelConfig& cfg = tc_.model;
    const uint64_t seed = tc_.train.seed;
    const float std = static_cast<float>(cfg.init_std);
    // The embedding: the first stage's, and the last stage's copy under a tied head.
    if (first_ || (last_ && cfg.tie_embeddings)) {
      embedding_ = std::make_unique<layers::Embedding>(cfg.vocab_size, cfg.d_model);
      embedding_->init(seed, "embedding", std);
    }
    const int64_t per_stage = cfg.n_layers / env.pp;
    block_lo_ = env.coord.pp * per_stage;
    const int64_t block_hi = block_lo_ + per_stage;
    // This rank's experts of each MoE block: [r*E/n, (r+1)*E/n) for n-rank r.
    layers::ExpertRange held;
    if (env.n_group != nullptr) {
      const int64_t n = env.n_group->size();
      TROUPE_CHECK(cfg.moe.num_experts % n == 0, "moe stage: {} experts do not split over n = {}",
                   cfg.moe.num_experts, n);
      held = {env.n_group->rank() * (cfg.moe.num_experts / n), cfg.moe.num_experts / n};
    }
    const training::DispatchMode mode =
        par.dispatch == "allgather" ? training::DispatchMode::kAllGather : training::DispatchMode::kAllToAll;
    int64_t moe_index = 0;
    // One set of mapped row buffers for every MoE block of this stage (device dispatch).
    std::shared_ptr<training::PeerRows> peer;
    if (env.n_group != nullptr && ctx_.on_device() && par.device_dispatch &&
        mode == training::DispatchMode::kAllToAll) {
      peer = std::make_shared<training::PeerRows>(*env.n_group, par.device_dispatch_required);
    }
    for (int64_t i = 0; i < cfg.n_layers; ++i) {
      const bool is_moe = cfg.is_moe_block(i);
      const int64_t mi = is_moe ? moe_index++ : -1;
      if (i < block_lo_ || i >= block_hi) continue;
      auto role = std::make_unique<Role>();
      role->block = std::make_unique<layers::Block>(cfg, is_moe, held);
      role->block->init(seed, fmt::format("blocks.{}", i), cfg);
      layers::Block& b = *role->block;
      role->moe_index = mi;
      if (env.n_group != nullptr) {
        comm::Communicator& group = *env.n_group;
        role->attn = std::make_unique<AttentionShard>(b.attn, group, env.time, par.overlap_a2a);
        if (b.is_moe()) {
          ExpertGroup::Options eo;
          eo.chunks = par.chunks;
          eo.overlap = par.overlap_a2a;
          eo.fp8 = par.fp8_dispatch;
          eo.peer = peer;
          role->experts = std::make_unique<ExpertGroup>(*b.moe, group, env.time, mode, eo);
          b.moe->set_dispatch(role->experts.get());
          b.moe->router.set_group_all_reduce([g = &group, time = &env.time](std::vector<double>& v) {
            training::sum_doubles(*g, v, *time, "router statistics");
          });
          // The same sums where the statistics stay in a tensor (bench.device_stats).
          b.moe->router.set_device_group_all_reduce([g = &group, time = &env.time](Tensor& v) {
            training::all_reduce_sum(*g, v, *time, "router statistics");
            return static_cast<int64_t>(g->size());
          });
        }
      }
      roles_.push_back(std::move(role));
    }
    num_moe_blocks_ = moe_index;
    if (last_) {
      head_ = std::make_unique<layers::LMHead>(cfg.vocab_size, cfg.d_model, static_cast<float>(cfg.norm_eps),
                                               cfg.tie_embeddings ? &embedding_->weight : nullptr);
      head_->init(seed, std);
    }
    if (ctx_.on_device()) {
      for (const auto& r : roles_) {
        if (r->block->is_moe()) r->block->moe->router.bias = ctx_.to_device(r->block->moe->router.bias);
      }
    }
    n_group_ = env.n;
    dp_ = env.dp;
    peer_ = peer;
  }

  std::vector<training::ProgramParam> parameters() override {
    std::vector<training::ProgramParam> out;
    const bool tie = tc_.model.tie_embeddings;
    if (first_) {
      training::ProgramParam p{"embedding.weight", &embedding_->weight};
      p.tied = tie;
      out.push_back(p);
    }
    for (size_t ri = 0; ri < roles_.size(); ++ri) {
      const Role& role = *roles_[ri];
      const int64_t i = block_lo_ + static_cast<int64_t>(ri);
      std::vector<layers::NamedParameter> ps;
      role.block->collect(fmt::format("blocks.{}", i), ps);
      for (auto& np : ps) {
        const bool is_expert = np.name.find(".moe.experts.") != std::string::npos;
        // With n > 1 the block holds this rank's experts: a "[local]" slice of the global
        // tensor (the Stage's state names and checkpoints).
        training::ProgramParam p{is_expert && role.experts ? np.name + "[local]" : np.name, np.param};
        p.sharded = is_expert;
        p.grad_ready = static_cast<int64_t>(ri);
        p.role = is_expert ? "experts" : np.name.find(".attn.") != std::string::npos ? "attention" : "";
        out.push_back(p);
      }
    }
    if (last_) {
      std::vector<layers::NamedParameter> ps;
      head_->collect(ps);
      for (auto& np : ps) {
        training::ProgramParam p{np.name, np.param};
        p.grad_ready = training::kGradReadyAfterHead;
        out.push_back(p);
      }
      // A tied head on a later stage holds a copy of the embedding.
      if (tie && !first_) {
        training::ProgramParam p{"embedding.weight[tied copy]", &embedding_->weight};
        p.tied_copy = true;
        out.push_back(p);
      }
    }
    return out;
  }

  std::vector<training::ProgramBuffer> buffers() override {
    std::vector<training::ProgramBuffer> out;
    for (size_t ri = 0; ri < roles_.size(); ++ri) {
      layers::Block& b = *roles_[ri]->block;
      if (!b.is_moe()) continue;
      out.push_back({fmt::format("blocks.{}.moe.router.bias", block_lo_ + static_cast<int64_t>(ri)),
                     &b.moe->router.bias});
    }
    return out;
  }

  int64_t activation_width() const override { return tc_.model.d_model; }

  layers::Embedding* embedding() override { return first_ ? embedding_.get() : nullptr; }
  layers::LMHead* head() override { return head_.get(); }

  int64_t num_blocks() const override { return static_cast<int64_t>(roles_.size()); }
  std::string block_name(int64_t i) const override { return fmt::format("block {}", block_lo_ + i); }

  // x + attention(norm1(x)), then h + ffn(norm2(h)) with ffn the MoE layer or the MLP.
  Tensor block_forward(const layers::Ctx& c, int64_t i, const Tensor& x, std::unique_ptr<Saved>& saved,
                       bool train) override {
    Role& r = *roles_[static_cast<size_t>(i)];
    layers::Block& b = *r.block;
    auto s = std::make_unique<BlockSaved>();
    Tensor h = layers::residual_forward(c, x, b.norm1, s->norm1, [&](const Tensor& n) {
      return r.attn ? r.attn->forward(c, n, batch_, seq_local_, s->attn_sp)
                    : b.attn.forward(c, n, batch_, seq_local_, s->attn);
    });
    Tensor y = layers::residual_forward(c, h, b.norm2, s->norm2, [&](const Tensor& n) {
      if (!b.is_moe()) return b.mlp->forward(c, n, s->mlp);
      layers::MoELayer::Stats st;
      Tensor f = b.moe->forward(c, n, s->moe, train ? &st : nullptr);
      // The aux loss is the same on every rank of the n-group (its statistics are summed
      // there): counted once.
      if (train && n_rank_ == 0) aux_acc_ += st.aux_loss * static_cast<double>(loss_weight_);
      return f;
    });
    saved = std::move(s);
    return y;
  }

  Tensor block_backward(const layers::Ctx& c, int64_t i, const Tensor& dy, Saved& saved) override {
    Role& r = *roles_[static_cast<size_t>(i)];
    layers::Block& b = *r.block;
    auto& s = static_cast<BlockSaved&>(saved);
    Tensor dh = layers::residual_backward(c, dy, b.norm2, s.norm2, [&](const Tensor& d) {
      return b.is_moe() ? b.moe->backward(c, d, s.moe, loss_weight_) : b.mlp->backward(c, d, s.mlp);
    });
    return layers::residual_backward(c, dh, b.norm1, s.norm1, [&](const Tensor& d) {
      return r.attn ? r.attn->backward(c, d, s.attn_sp) : b.attn.backward(c, d, s.attn);
    });
  }

  // Device statistics (bench.device_stats): one row per MoE block of the whole model,
  // [E selections, aux loss] padded to stride_, so every rank's buffer has the same layout
  // (a stage fills its own blocks' rows). Each block's router accumulates its row
  // (MoELayer::set_device_stats; with n > 1 summed over the n-group on the device; a
  // z-loss is added to the aux loss there too).
  int64_t device_stats_size() const override {
    for (const auto& r : roles_)
      TROUPE_CHECK(
          !r->block->is_moe() || r->block->moe->router.device_stats_ok(ctx_),
          "moe stage: a router cannot keep its statistics on the device although the config allows it");
    const int64_t e = tc_.model.moe.num_experts;
    return num_moe_blocks_ * ((e + 1 + 3) / 4 * 4);
  }

  void bind_device_stats(const Tensor& rows) override {
    const int64_t e = tc_.model.moe.num_experts;
    stride_ = (e + 1 + 3) / 4 * 4;  // 16-byte aligned rows
    stats_rows_ = rows;
    for (const auto& r : roles_) {
      if (r->moe_index < 0) continue;
      const bool ok = r->block->moe->set_device_stats(ctx_, rows.narrow(0, r->moe_index * stride_, e + 1));
      TROUPE_CHECK(ok, "moe stage: MoE block refused device statistics after device_stats_size");
    }
  }

  // The rows of the n-group's members are its sums, the same on each: n-rank 0 counts them.
  void finish_device_stats(const layers::Ctx& c) override {
    if (n_rank_ != 0 && stats_rows_.defined()) kernels::fill(c.ex, stats_rows_, 0.0f);
  }

  // Host statistics: [aux loss, then per MoE block of the whole model, per expert: its
  // selections]. The loads are the same on every rank of the n-group: n-rank 0 counts them.
  std::vector<double> step_stats() override {
    const int64_t e = tc_.model.moe.num_experts;
    std::vector<double> v(static_cast<size_t>(1 + num_moe_blocks_ * e), 0.0);
    v[0] = aux_acc_;
    aux_acc_ = 0;
    if (n_rank_ == 0) {
      for (const auto& r : roles_) {
        if (r->moe_index < 0) continue;
        const auto& load = r->block->moe->step_load();
        for (int64_t j = 0; j < e; ++j)
          v[static_cast<size_t>(1 + r->moe_index * e + j)] +=
              static_cast<double>(load[static_cast<size_t>(j)]);
      }
    }
    return v;
  }

  void end_step(const layers::Ctx& c, const std::vector<double>& summed, training::StepReport& rep) override {
    const int64_t e = tc_.model.moe.num_experts;
    const int64_t nmoe = num_moe_blocks_;
    rep.expert_load.assign(static_cast<size_t>(nmoe), std::vector<int64_t>(static_cast<size_t>(e), 0));
    if (stats_rows_.defined()) {
      // The world's sums of every block's row: each of this stage's blocks checks its
      // counts (summed over the dp replicas, each routing the same tokens) and takes its
      // step_load; the aux loss is summed unweighted, every micro-batch weighing the same.
      double aux = 0;
      std::vector<float> row(static_cast<size_t>(e + 1));
      for (int64_t i = 0; i < nmoe; ++i) {
        const double* p = summed.data() + i * stride_;
        for (int64_t j = 0; j < e; ++j)
          rep.expert_load[static_cast<size_t>(i)][static_cast<size_t>(j)] = std::llround(p[j]);
        aux += p[e];
      }
      for (const auto& r : roles_) {
        if (r->moe_index < 0) continue;
        const double* p = summed.data() + r->moe_index * stride_;
        for (int64_t j = 0; j <= e; ++j) row[static_cast<size_t>(j)] = static_cast<float>(p[j]);
        r->block->moe->absorb_device_stats(row.data(), dp_);
      }
      rep.aux_loss = aux * static_cast<double>(loss_weight_);
    } else {
      rep.aux_loss = summed[0];
      for (int64_t i = 0; i < nmoe; ++i)
        for (int64_t j = 0; j < e; ++j)
          rep.expert_load[static_cast<size_t>(i)][static_cast<size_t>(j)] =
              std::llround(summed[static_cast<size_t>(1 + i * e + j)]);
    }
    // The aux-loss-free balancing bias, from the loads summed over the world (as one
    // process updates it); also clears each block's step_load.
    for (const auto& r : roles_) {
      if (r->moe_index < 0) continue;
      const auto& load = rep.expert_load[static_cast<size_t>(r->moe_index)];
      if (c.on_device()) {
        r->block->moe->update_bias(c, load);
      } else {
        r->block->moe->update_bias(load);
      }
    }
  }

  bool updates_between_steps() const override {
    for (const auto& r : roles_)
      if (r->block->is_moe() && r->block->moe->router.cfg.bias_update_rate > 0) return true;
    return false;
  }

  void discard_step() override {
    aux_acc_ = 0;
    for (const auto& r : roles_) {
      if (r->block->is_moe()) r->block->moe->update_bias(std::vector<int64_t>{});  // clears step_load only
    }
  }

  std::string graph_blocker() const override {
    if (n_group_ <= 1 || num_moe_blocks_ == 0) return "";
    if (peer_ == nullptr) {
      return "the expert dispatch over the n-group reads its token counts on the host in every MoE block "
             "(parallel.device_dispatch = false, or dispatch = \"allgather\")";
    }
    // The device dispatch maps its peers' row buffers (worst-case sized) in the first step,
    // which runs op by op, and again only in a new membership epoch (the graph is then
    // captured anew after another step op by op): a captured step maps nothing.
    if (peer_->host_counts()) {
      return "the expert dispatch over the n-group went through the host counts (the group spans hosts, "
             "or its GPUs cannot map each other's memory)";
    }
    return "";
  }

  // A replay skips forward's host bookkeeping: each block's expected selections
  // (MoELayer::pending_selections), which the captured step added once.
  void step_captured() override {
    captured_selections_.clear();
    for (const auto& r : roles_)
      captured_selections_.push_back(r->moe_index >= 0 ? r->block->moe->pending_selections() : 0);
  }
  void step_replayed() override {
    for (size_t i = 0; i < roles_.size(); ++i)
      if (roles_[i]->moe_index >= 0)
        roles_[i]->block->moe->add_pending_selections(captured_selections_.at(i));
  }

 private:
  struct Role {
    std::unique_ptr<layers::Block> block;  // with this rank's experts only when n > 1
    int64_t moe_index = -1;                // index among the model's MoE blocks, -1 for dense
    std::unique_ptr<AttentionShard> attn;  // n > 1
    std::unique_ptr<ExpertGroup> experts;  // MoE and n > 1
  };
  struct BlockSaved final : Saved {
    layers::RMSNorm::Saved norm1, norm2;
    layers::Attention::Saved attn;
    AttentionShard::Saved attn_sp;
    layers::SwiGLUMLP::Saved mlp;
    layers::MoELayer::Saved moe;
  };

  const layers::TrainConfig tc_;
  const layers::Ctx& ctx_;
  bool first_, last_;
  int n_rank_;
  int64_t batch_, seq_local_;
  float loss_weight_;
  std::unique_ptr<layers::Embedding> embedding_;  // first stage; last stage's copy when tied
  std::vector<std::unique_ptr<Role>> roles_;      // this stage's blocks, in order
  std::unique_ptr<layers::LMHead> head_;          // last stage
  int64_t block_lo_ = 0;
  int64_t num_moe_blocks_ = 0;  // of the whole model
  double aux_acc_ = 0;
  Tensor stats_rows_;  // device statistics: per MoE block of the model, [E counts, aux] padded to stride_
  int64_t stride_ = 0;
  int n_group_ = 1, dp_ = 1;
  std::shared_ptr<training::PeerRows> peer_;  // device dispatch over the n-group (null: host counts)
  std::vector<int64_t> captured_selections_;  // per role: the captured step's expected selections
};

}  // namespace

training::ProgramFactory moe_stage_program() {
  return [](const training::StageEnv& env) -> Result<std::unique_ptr<training::StageProgram>> {
    TROUPE_RETURN_IF_ERROR(env.tc.model.validate());
    return std::unique_ptr<training::StageProgram>(std::make_unique<MoeStage>(env));
  };
}

training::App moe_app() {
  training::App app;
  app.name = "train_moe";
  app.program = moe_stage_program();
  return app;
}

}  // namespace troupe::train_moe
