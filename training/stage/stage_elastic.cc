// training/stage/stage_elastic.cc — the Stage's elastic-recovery members (stage.h,
// "elastic recovery"): communicators that can be aborted and rebuilt in a new epoch, and
// the clean-up after an interrupted step. The state a recovery goes back to is a
// snapshot's (stage_snapshot.cc) or a checkpoint's: every rank restores it, so nothing
// here keeps a copy of the state.
#include <fmt/format.h>

#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "training/stage/stage.h"

namespace troupe::training {

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
  if (graph_ && layout_->world_size() > 1) {
    graph_->reset();
    graph_warm_ = false;  // the new epoch's first step runs op by op (the program set-up anew)
  }
  for (ElasticComm* c : elastic_comms_) {
    TROUPE_RETURN_IF_ERROR(c->rebuild(ns).with_context(fmt::format("rebuilding communicator {}", c->spec().name)));
  }
  return ok_status();
}

void Stage::clear_interrupted_step() {
  // An interrupted step: its sends completed (aborted) when the communicators were
  // aborted; what the program accumulated (e.g. expert loads) must not reach the next step,
  // nor may a step launched behind it.
  pending_sends_.clear();
  pending_send_ops_.clear();
  // A parameter all-gather still pending is the interrupted step's (elastic workers await
  // theirs inside the step): its communicator was aborted and the state it would gather is
  // rolled back; awaited now, it would raise the old epoch's error in the new one.
  for (auto& bk : buckets_) bk.param = Bucket();
  params_pending_ = false;
  // The same for what the device-mode timer kept in flight (issued on those communicators).
  time_.drop_in_flight();
  launched_.clear();
  first_marked_step_ = -1;  // the next step's gap to a step before the failure means nothing
  if (graph_ && graph_->capturing()) {
    (void)graph_->end_capture();  // a step interrupted while captured: nothing to keep
    graph_->reset();
    graph_warm_ = false;
  }
  program_->discard_step();
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

}  // namespace troupe::training
