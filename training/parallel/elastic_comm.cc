// training/parallel/elastic_comm.cc — ElasticComm (a communicator with a replaceable
// backend) and the process-wide "throw on data-plane error" switch.
#include "training/parallel/elastic_comm.h"

#include <atomic>

namespace troupe::training {

namespace {
std::atomic<bool> g_throw{false};
std::atomic<FaultHook> g_fault_hook{nullptr};
}  // namespace

void set_fault_hook(FaultHook hook) { g_fault_hook.store(hook); }
void fault_point(std::string_view what) {
  if (FaultHook h = g_fault_hook.load()) h(what);
}

void set_throw_on_comm_error(bool on) { g_throw.store(on); }
bool throw_on_comm_error() { return g_throw.load(); }

Result<std::unique_ptr<ElasticComm>> ElasticComm::create(const comm::CommSpec& spec, comm::CommFactory factory) {
  std::unique_ptr<ElasticComm> c(new ElasticComm(spec, std::move(factory)));
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> inner, c->factory_(spec));
  c->inner_ = std::move(inner);
  return c;
}

std::shared_ptr<comm::Communicator> ElasticComm::inner() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inner_;
}

std::string_view ElasticComm::backend() const { return inner()->backend(); }
Device ElasticComm::device() const { return inner()->device(); }

comm::WorkPtr ElasticComm::all_reduce(Tensor tensor, comm::ReduceOp op, const comm::OpOptions& opts) {
  return inner()->all_reduce(std::move(tensor), op, opts);
}
comm::WorkPtr ElasticComm::reduce_scatter(Tensor input, Tensor output, comm::ReduceOp op,
                                          const comm::OpOptions& opts) {
  return inner()->reduce_scatter(std::move(input), std::move(output), op, opts);
}
comm::WorkPtr ElasticComm::all_gather(Tensor input, Tensor output, const comm::OpOptions& opts) {
  return inner()->all_gather(std::move(input), std::move(output), opts);
}
comm::WorkPtr ElasticComm::all_to_all(Tensor input, Tensor output, const comm::OpOptions& opts) {
  return inner()->all_to_all(std::move(input), std::move(output), opts);
}
comm::WorkPtr ElasticComm::all_to_all_v(Tensor input, std::vector<int64_t> send_counts, Tensor output,
                                        std::vector<int64_t> recv_counts, const comm::OpOptions& opts) {
  return inner()->all_to_all_v(std::move(input), std::move(send_counts), std::move(output), std::move(recv_counts),
                               opts);
}
comm::WorkPtr ElasticComm::send(Tensor tensor, int peer, const comm::OpOptions& opts) {
  return inner()->send(std::move(tensor), peer, opts);
}
comm::WorkPtr ElasticComm::recv(Tensor tensor, int peer, const comm::OpOptions& opts) {
  return inner()->recv(std::move(tensor), peer, opts);
}
comm::WorkPtr ElasticComm::broadcast(Tensor tensor, int root, const comm::OpOptions& opts) {
  return inner()->broadcast(std::move(tensor), root, opts);
}
comm::WorkPtr ElasticComm::barrier(const comm::OpOptions& opts) { return inner()->barrier(opts); }
comm::WorkPtr ElasticComm::fence(const comm::OpOptions& opts) {
  return inner()->fence(opts);
}

void ElasticComm::abort(std::string_view reason) { inner()->abort(reason); }
Status ElasticComm::health() const { return inner()->health(); }

Status ElasticComm::rebuild(const comm::StoreNamespace& ns) {
  std::shared_ptr<comm::Communicator> old = inner();
  old->abort("rebuilding in a new epoch");
  comm::CommSpec spec = spec_;
  spec.ns = ns;
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> fresh, factory_(spec));
  std::lock_guard<std::mutex> lock(mu_);
  inner_ = std::move(fresh);
  spec_ = spec;
  generation_.fetch_add(1);
  return ok_status();
}

}  // namespace troupe::training
