// comm/gloo_communicator.cc — GlooCommunicator: Communicator over Gloo's TCP transport.
#include "comm/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <signal.h>

#include <cstring>
#include <deque>
#include <functional>
#include <thread>

#include "comm/gloo_store.h"

namespace troupe::comm {
namespace {

using Millis = std::chrono::milliseconds;
using ReduceFn = void (*)(void*, const void*, const void*, size_t);

// Point-to-point slots live apart from Gloo's collective slots (whose prefixes are small
// integers in the top byte).
constexpr uint64_t kP2pSlotBase = uint64_t{0xE0} << 56;

// Maps a Gloo exception to a Status: timeouts are kDeadlineExceeded, the rest (peer
// closed, reset, refused) kUnavailable.
Status status_from_gloo(const std::string& what, const std::exception& e) {
  std::string msg = e.what();
  if (msg.find("Timed out") != std::string::npos || msg.find("timed out") != std::string::npos ||
      msg.find("timeout") != std::string::npos) {
    return deadline_exceeded("{}: {}", what, msg);
  }
  return unavailable("{}: {}", what, msg);
}

template <typename T>
ReduceFn reduce_fn(ReduceOp op) {
  if (op == ReduceOp::kMax) return static_cast<ReduceFn>(&gloo::max<T>);
  return static_cast<ReduceFn>(&gloo::sum<T>);
}

// acc[i] = op(acc[i], x[i]).
template <typename T>
void accumulate(T* acc, const T* x, size_t n, ReduceOp op) {
  if (op == ReduceOp::kSum) {
    for (size_t i = 0; i < n; ++i) acc[i] += x[i];
  } else {
    for (size_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], x[i]);
  }
}

struct CollectiveTask {
  WorkPtr work;
  std::function<void(Millis, uint32_t)> run;  // throws gloo::Exception on failure
  Millis timeout;
  std::vector<Tensor> keep;  // tensors referenced until completion
};

struct P2pTask {
  WorkPtr work;
  std::unique_ptr<gloo::transport::UnboundBuffer> buf;
  bool is_send = true;
  int peer = 0;
  Millis timeout;
  Tensor keep;
};

// Everything the worker threads touch; shared so threads may outlive the communicator
// object after an abort (they finish within their operation's timeout).
struct State {
  CommSpec spec;
  std::shared_ptr<gloo::rendezvous::Context> ctx;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<CollectiveTask> collectives;
  std::deque<std::shared_ptr<P2pTask>> p2p;
  WorkPtr running;                       // collective being executed
  std::shared_ptr<P2pTask> p2p_current;  // p2p being waited on
  Status health;                         // first error or abort reason
  bool stop = false;
  bool connections_closed = false;
  uint32_t next_tag = 1;
  std::vector<uint64_t> send_seq, recv_seq;

  // Records the first error, closes every connection once (peers blocked on us fail
  // fast), and fails everything pending. Call without `mu` held.
  void poison(const Status& st);
};

void State::poison(const Status& st) {
  std::vector<WorkPtr> fail;
  std::vector<std::shared_ptr<P2pTask>> p2p_fail;
  bool close_now = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (health.ok()) health = st;
    for (auto& t : collectives) fail.push_back(t.work);
    collectives.clear();
    if (running) fail.push_back(running);
    for (auto& t : p2p) p2p_fail.push_back(t);
    p2p.clear();
    if (p2p_current) p2p_fail.push_back(p2p_current);
    if (!connections_closed) {
      connections_closed = true;
      close_now = true;
    }
  }
  Status reason = st.code() == StatusCode::kAborted
                      ? st
                      : failed_precondition("communicator '{}' failed: {}", spec.name, st.to_string());
  for (auto& w : fail) w->complete(reason);
  for (auto& t : p2p_fail) {
    t->work->complete(reason);
    if (t->is_send) {
      t->buf->abortWaitSend();
    } else {
      t->buf->abortWaitRecv();
    }
  }
  cv.notify_all();
  if (close_now && ctx) {
    try {
      ctx->closeConnections();
    } catch (const std::exception&) {
      // Closing an already broken pair may throw; the connections are gone either way.
    }
  }
}

void collective_loop(std::shared_ptr<State> s) {
  for (;;) {
    CollectiveTask task;
    uint32_t tag = 0;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->stop || !s->collectives.empty(); });
      if (s->collectives.empty()) return;  // stop requested and nothing left
      task = std::move(s->collectives.front());
      s->collectives.pop_front();
      if (!s->health.ok()) {
        Status st = s->health;
        lock.unlock();
        task.work->complete(
            st.code() == StatusCode::kAborted
                ? st
                : failed_precondition("communicator '{}' failed earlier: {}", s->spec.name, st.to_string()));
        continue;
      }
      s->running = task.work;
      tag = s->next_tag++;
    }
    Status st;
    task.work->mark_started();
    try {
      task.run(task.timeout, tag);
    } catch (const std::exception& e) {
      st = status_from_gloo(task.work->what(), e);
    }
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->running.reset();
    }
    if (!st.ok()) s->poison(st);
    task.work->complete(st);
  }
}

void p2p_loop(std::shared_ptr<State> s) {
  for (;;) {
    std::shared_ptr<P2pTask> task;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->stop || !s->p2p.empty(); });
      if (s->p2p.empty()) return;
      task = s->p2p.front();
      s->p2p.pop_front();
      s->p2p_current = task;
    }
    Status st;
    try {
      bool done = task->is_send ? task->buf->waitSend(task->timeout) : task->buf->waitRecv(task->timeout);
      if (!done) st = aborted("{}: aborted", task->work->what());
    } catch (const std::exception& e) {
      st = status_from_gloo(task->work->what(), e);
    }
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->p2p_current.reset();
    }
    if (!st.ok() && st.code() != StatusCode::kAborted) s->poison(st);
    task->work->complete(st);
  }
}

class GlooCommunicator final : public Communicator {
 public:
  explicit GlooCommunicator(std::shared_ptr<State> s) : s_(std::move(s)) {
    collective_thread_ = std::thread(collective_loop, s_);
    p2p_thread_ = std::thread(p2p_loop, s_);
  }

  ~GlooCommunicator() override {
    bool busy;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      busy = s_->running != nullptr || s_->p2p_current != nullptr || !s_->collectives.empty() ||
             !s_->p2p.empty();
    }
    if (busy) s_->poison(aborted("communicator '{}' destroyed with operations pending", s_->spec.name));
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      s_->stop = true;
      busy = s_->running != nullptr;
    }
    s_->cv.notify_all();
    p2p_thread_.join();  // its waits were aborted above
    // A collective blocked inside Gloo ends at its own timeout; don't make the caller wait
    // for it (the thread owns a reference to the state it uses).
    if (busy) {
      collective_thread_.detach();
    } else {
      collective_thread_.join();
    }
  }

  int rank() const override { return s_->spec.rank; }
  int size() const override { return s_->spec.size; }
  std::string_view backend() const override { return "gloo"; }
  Device device() const override { return Device::cpu(); }
  const CommSpec& spec() const override { return s_->spec; }

  WorkPtr all_reduce(Tensor t, ReduceOp op, const OpOptions& opts) override {
    std::string what =
        fmt::format("all_reduce({}, {})", reduce_op_name(op), t.defined() ? t.describe() : "?");
    Status st = detail::check_tensor(t, Device::cpu(), what);
    if (st.ok()) st = detail::check_reduce_dtype(t.dtype(), what);
    if (!st.ok()) return Work::completed(what, st);
    auto ctx = s_->ctx;
    auto run = [ctx, t, op](Millis timeout, uint32_t tag) {
      if (t.numel() == 0) return;
      auto reduce_as = [&](auto* ptr, size_t n, ReduceFn fn) {
        using T = std::remove_pointer_t<decltype(ptr)>;
        gloo::AllreduceOptions o(ctx);
        o.setOutput<T>(ptr, n);
        o.setReduceFunction(fn);
        o.setTag(tag);
        o.setTimeout(timeout);
        gloo::allreduce(o);
      };
      size_t n = static_cast<size_t>(t.numel());
      switch (t.dtype()) {
        case DType::kF32:
          reduce_as(t.data<float>(), n, reduce_fn<float>(op));
          break;
        case DType::kI32:
          reduce_as(t.data<int32_t>(), n, reduce_fn<int32_t>(op));
          break;
        case DType::kI64:
          reduce_as(t.data<int64_t>(), n, reduce_fn<int64_t>(op));
          break;
        default: {  // bf16, f16: reduce in fp32
          std::vector<float> tmp(n);
          convert_dtype(t.data_ptr(), t.dtype(), tmp.data(), DType::kF32, n);
          reduce_as(tmp.data(), n, reduce_fn<float>(op));
          convert_dtype(tmp.data(), DType::kF32, t.data_ptr(), t.dtype(), n);
        }
      }
    };
    return enqueue(std::move(what), std::move(run), opts, {t});
  }

  WorkPtr reduce_scatter(Tensor in, Tensor out, ReduceOp op, const OpOptions& opts) override {
    std::string what = fmt::format("reduce_scatter({}, {} -> {})", reduce_op_name(op),
                                   in.defined() ? in.describe() : "?", out.defined() ? out.describe() : "?");
    Status st = detail::check_tensor(in, Device::cpu(), what);
    if (st.ok()) st = detail::check_tensor(out, Device::cpu(), what);
    if (st.ok()) st = detail::check_reduce_dtype(in.dtype(), what);
    if (st.ok() && in.dtype() != out.dtype()) st = invalid_argument("{}: dtypes differ", what);
    if (st.ok() && in.numel() != out.numel() * size()) {
      st = invalid_argument("{}: input has {} elements, expected size {} x output {}", what, in.numel(),
                            size(), out.numel());
    }
    if (!st.ok()) return Work::completed(what, st);
    auto ctx = s_->ctx;
    int n_ranks = size();
    auto run = [ctx, in, out, op, n_ranks](Millis timeout, uint32_t tag) {
      const size_t m = static_cast<size_t>(out.numel());
      if (m == 0) return;
      const size_t esize = in.element_size();
      // Exchange: chunk p of every rank's input lands as chunk (sender) of p's buffer.
      std::vector<uint8_t> gathered(m * esize * n_ranks);
      gloo::AlltoallOptions o(ctx);
      o.setInput<uint8_t>(static_cast<uint8_t*>(in.data_ptr()), gathered.size());
      o.setOutput<uint8_t>(gathered.data(), gathered.size());
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::alltoall(o);
      // Local reduction in rank order.
      auto reduce_chunks = [&](auto* acc, const auto* chunks) {
        std::memcpy(acc, chunks, m * sizeof(*acc));
        for (int r = 1; r < n_ranks; ++r) accumulate(acc, chunks + r * m, m, op);
      };
      switch (in.dtype()) {
        case DType::kF32:
          reduce_chunks(out.data<float>(), reinterpret_cast<const float*>(gathered.data()));
          break;
        case DType::kI32:
          reduce_chunks(out.data<int32_t>(), reinterpret_cast<const int32_t*>(gathered.data()));
          break;
        case DType::kI64:
          reduce_chunks(out.data<int64_t>(), reinterpret_cast<const int64_t*>(gathered.data()));
          break;
        default: {  // bf16, f16: sum in fp32, round once
          std::vector<float> wide(m * n_ranks), acc(m);
          convert_dtype(gathered.data(), in.dtype(), wide.data(), DType::kF32, wide.size());
          reduce_chunks(acc.data(), wide.data());
          convert_dtype(acc.data(), DType::kF32, out.data_ptr(), out.dtype(), m);
        }
      }
    };
    return enqueue(std::move(what), std::move(run), opts, {in, out});
  }

  WorkPtr all_gather(Tensor in, Tensor out, const OpOptions& opts) override {
    std::string what = fmt::format("all_gather({} -> {})", in.defined() ? in.describe() : "?",
                                   out.defined() ? out.describe() : "?");
    Status st = check_pair(in, out, what);
    if (st.ok() && out.numel() != in.numel() * size()) {
      st = invalid_argument("{}: output has {} elements, expected size {} x input {}", what, out.numel(),
                            size(), in.numel());
    }
    if (!st.ok()) return Work::completed(what, st);
    auto ctx = s_->ctx;
    auto run = [ctx, in, out](Millis timeout, uint32_t tag) {
      if (in.nbytes() == 0) return;
      gloo::AllgatherOptions o(ctx);
      o.setInput<uint8_t>(static_cast<uint8_t*>(in.data_ptr()), in.nbytes());
      o.setOutput<uint8_t>(static_cast<uint8_t*>(out.data_ptr()), out.nbytes());
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::allgather(o);
    };
    return enqueue(std::move(what), std::move(run), opts, {in, out});
  }

  WorkPtr all_to_all(Tensor in, Tensor out, const OpOptions& opts) override {
    std::string what = fmt::format("all_to_all({} -> {})", in.defined() ? in.describe() : "?",
                                   out.defined() ? out.describe() : "?");
    Status st = check_pair(in, out, what);
    if (st.ok() && (in.numel() != out.numel() || in.numel() % size() != 0)) {
      st =
          invalid_argument("{}: input and output need the same element count, divisible by {}", what, size());
    }
    if (!st.ok()) return Work::completed(what, st);
    auto ctx = s_->ctx;
    auto run = [ctx, in, out](Millis timeout, uint32_t tag) {
      if (in.nbytes() == 0) return;
      gloo::AlltoallOptions o(ctx);
      o.setInput<uint8_t>(static_cast<uint8_t*>(in.data_ptr()), in.nbytes());
      o.setOutput<uint8_t>(static_cast<uint8_t*>(out.data_ptr()), out.nbytes());
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::alltoall(o);
    };
    return enqueue(std::move(what), std::move(run), opts, {in, out});
  }

  WorkPtr all_to_all_v(Tensor in, std::vector<int64_t> send_counts, Tensor out,
                       std::vector<int64_t> recv_counts, const OpOptions& opts) override {
    std::string what = fmt::format("all_to_all_v({} -> {})", in.defined() ? in.describe() : "?",
                                   out.defined() ? out.describe() : "?");
    Status st = check_pair(in, out, what);
    if (st.ok()) st = detail::check_counts(send_counts, size(), in.numel(), what + " send_counts");
    if (st.ok()) st = detail::check_counts(recv_counts, size(), out.numel(), what + " recv_counts");
    if (st.ok() && send_counts[rank()] != recv_counts[rank()]) {
      st = invalid_argument("{}: send_counts[self]={} != recv_counts[self]={}", what, send_counts[rank()],
                            recv_counts[rank()]);
    }
    if (!st.ok()) return Work::completed(what, st);
    auto ctx = s_->ctx;
    auto run = [ctx, in, out, send_counts = std::move(send_counts), recv_counts = std::move(recv_counts)](
                   Millis timeout, uint32_t tag) {
      // Every rank takes part even with nothing to move: peers expect our (empty) messages.
      const int64_t esize = static_cast<int64_t>(in.element_size());
      std::vector<int64_t> send_bytes, recv_bytes;
      for (auto c : send_counts) send_bytes.push_back(c * esize);
      for (auto c : recv_counts) recv_bytes.push_back(c * esize);
      uint8_t dummy_in = 0, dummy_out = 0;
      auto* in_ptr = in.nbytes() ? static_cast<uint8_t*>(in.data_ptr()) : &dummy_in;
      auto* out_ptr = out.nbytes() ? static_cast<uint8_t*>(out.data_ptr()) : &dummy_out;
      gloo::AlltoallvOptions o(ctx);
      o.setInput<uint8_t>(in_ptr, send_bytes);
      o.setOutput<uint8_t>(out_ptr, recv_bytes);
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::alltoallv(o);
    };
    return enqueue(std::move(what), std::move(run), opts, {in, out});
  }

  WorkPtr broadcast(Tensor t, int root, const OpOptions& opts) override {
    std::string what = fmt::format("broadcast({}, root {})", t.defined() ? t.describe() : "?", root);
    Status st = detail::check_tensor(t, Device::cpu(), what);
    if (st.ok() && (root < 0 || root >= size()))
      st = invalid_argument("{}: root not in [0, {})", what, size());
    if (!st.ok()) return Work::completed(what, st);
    auto ctx = s_->ctx;
    auto run = [ctx, t, root](Millis timeout, uint32_t tag) {
      if (t.nbytes() == 0) return;
      gloo::BroadcastOptions o(ctx);
      o.setOutput<uint8_t>(static_cast<uint8_t*>(t.data_ptr()), t.nbytes());
      o.setRoot(root);
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::broadcast(o);
    };
    return enqueue(std::move(what), std::move(run), opts, {t});
  }

  WorkPtr barrier(const OpOptions& opts) override {
    auto ctx = s_->ctx;
    auto run = [ctx](Millis timeout, uint32_t tag) {
      gloo::BarrierOptions o(ctx);
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::barrier(o);
    };
    return enqueue("barrier", std::move(run), opts, {});
  }

  WorkPtr send(Tensor t, int peer, const OpOptions& opts) override {
    return post_p2p(std::move(t), peer, true, opts);
  }
  WorkPtr recv(Tensor t, int peer, const OpOptions& opts) override {
    return post_p2p(std::move(t), peer, false, opts);
  }

  void abort(std::string_view reason) override {
    s_->poison(aborted("communicator '{}' aborted: {}", s_->spec.name, reason));
  }

  Status health() const override {
    std::lock_guard<std::mutex> lock(s_->mu);
    return s_->health;
  }

 private:
  Status check_pair(const Tensor& in, const Tensor& out, const std::string& what) const {
    Status st = detail::check_tensor(in, Device::cpu(), what);
    if (st.ok()) st = detail::check_tensor(out, Device::cpu(), what);
    if (st.ok() && in.dtype() != out.dtype()) {
      st = invalid_argument("{}: input is {} but output is {}", what, dtype_name(in.dtype()),
                            dtype_name(out.dtype()));
    }
    return st;
  }

  // Status of an operation issued after a failure or abort (call with s_->mu held).
  Status unusable(const std::string& what) const {
    if (s_->health.code() == StatusCode::kAborted) return aborted("{}: {}", what, s_->health.message());
    return failed_precondition("{}: communicator '{}' is unusable: {}", what, s_->spec.name,
                               s_->health.to_string());
  }

  WorkPtr enqueue(std::string what, std::function<void(Millis, uint32_t)> run, const OpOptions& opts,
                  std::vector<Tensor> keep) {
    auto work = std::make_shared<Work>(std::move(what));
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      if (!s_->health.ok()) {
        work->complete(unusable(work->what()));
        return work;
      }
      s_->collectives.push_back(
          CollectiveTask{work, std::move(run), detail::op_timeout(opts, s_->spec.options), std::move(keep)});
    }
    s_->cv.notify_all();
    return work;
  }

  WorkPtr post_p2p(Tensor t, int peer, bool is_send, const OpOptions& opts) {
    std::string what =
        fmt::format("{}({}, peer {})", is_send ? "send" : "recv", t.defined() ? t.describe() : "?", peer);
    Status st = detail::check_tensor(t, Device::cpu(), what);
    if (st.ok()) st = detail::check_peer(peer, size(), rank(), what);
    if (!st.ok()) return Work::completed(what, st);
    auto task = std::make_shared<P2pTask>();
    task->work = std::make_shared<Work>(std::move(what));
    task->is_send = is_send;
    task->peer = peer;
    task->timeout = detail::op_timeout(opts, s_->spec.options);
    task->keep = t;
    Status post_error;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      if (!s_->health.ok()) {
        task->work->complete(unusable(task->work->what()));
        return task->work;
      }
      // Empty messages still travel, so both sides stay in step.
      uint64_t seq = is_send ? s_->send_seq[peer]++ : s_->recv_seq[peer]++;
      uint64_t slot = kP2pSlotBase | (seq & 0x00FFFFFFFFFFFFFFull);
      void* ptr = t.nbytes() ? t.data_ptr() : static_cast<void*>(&task->peer);
      try {
        task->buf = s_->ctx->createUnboundBuffer(ptr, t.nbytes());
        if (is_send) {
          task->buf->send(peer, slot, 0, t.nbytes());
        } else {
          task->buf->recv(peer, slot, 0, t.nbytes());
        }
        s_->p2p.push_back(task);
      } catch (const std::exception& e) {
        post_error = status_from_gloo(task->work->what(), e);
      }
    }
    if (!post_error.ok()) {
      s_->poison(post_error);
      task->work->complete(post_error);
      return task->work;
    }
    s_->cv.notify_all();
    return task->work;
  }

  std::shared_ptr<State> s_;
  std::thread collective_thread_;
  std::thread p2p_thread_;
};

// Gloo writes to sockets without MSG_NOSIGNAL: a write to a peer that just died raises
// SIGPIPE, whose default action kills the process. Ignore it (unless the application
// installed its own handler) so the write fails with EPIPE and becomes an error Status.
void ignore_sigpipe_once() {
  static const bool done = [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      ::sigaction(SIGPIPE, &ignore, nullptr);
    }
    return true;
  }();
  (void)done;
}

}  // namespace

Result<std::unique_ptr<Communicator>> make_gloo_communicator(const CommSpec& spec,
                                                             const GlooTransportOptions& transport) {
  TROUPE_RETURN_IF_ERROR(spec.validate());
  ignore_sigpipe_once();
  auto s = std::make_shared<State>();
  s->spec = spec;
  s->spec.store = nullptr;  // used during creation only
  s->send_seq.assign(spec.size, 0);
  s->recv_seq.assign(spec.size, 0);
  try {
    gloo::transport::tcp::attr attr;
    if (!transport.iface.empty()) {
      attr.iface = transport.iface;
    } else {
      attr.hostname = transport.hostname;
    }
    auto device = gloo::transport::tcp::CreateDevice(attr);
    PrefixStore prefixed(*spec.store, spec.key_prefix());
    GlooStore store(prefixed, spec.options.init_timeout);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(spec.rank, spec.size);
    ctx->setTimeout(spec.options.init_timeout);
    ctx->connectFullMesh(store, device);
    ctx->setTimeout(spec.options.op_timeout);
    s->ctx = std::move(ctx);
  } catch (const std::exception& e) {
    return unavailable("gloo communicator '{}' (rank {} of {}, {}): set-up failed: {}", spec.name, spec.rank,
                       spec.size, spec.key_prefix(), e.what());
  }
  return std::unique_ptr<Communicator>(new GlooCommunicator(std::move(s)));
}

}  // namespace troupe::comm
