// scheduler/rendezvous.cc — RendezvousTable.
#include "scheduler/rendezvous.h"

#include <algorithm>

namespace troupe::sched {

std::optional<std::string> RendezvousTable::lookup(const std::string& job, uint64_t epoch, const std::string& key) {
  auto it = values_.find(Key{job, epoch, key});
  if (it != values_.end()) return it->second;
  if (durable_) {
    auto v = durable_->kv_get(job, epoch, key);
    if (v.ok() && v->has_value()) {
      values_[Key{job, epoch, key}] = **v;
      return **v;
    }
  }
  return std::nullopt;
}

std::optional<Reply> RendezvousTable::try_complete(const StoreRequest& req) {
  Reply r;
  for (const auto& k : req.keys) {
    auto v = lookup(req.job_id, req.epoch, k);
    if (!v) return std::nullopt;
    if (req.op == StoreOp::kGet) r.data = *v;
  }
  return r;
}

std::optional<Reply> RendezvousTable::handle(const StoreRequest& req, uint64_t token, Clock::time_point now) {
  if (req.job_id.empty()) return Reply::of(invalid_argument("store: no job id"));
  if (req.keys.empty()) return Reply::of(invalid_argument("store: no key"));
  for (const auto& k : req.keys) {
    if (k.empty() || k.size() > kMaxKeyBytes) {
      return Reply::of(invalid_argument("store: key must have 1..{} bytes, got {}", kMaxKeyBytes, k.size()));
    }
  }
  switch (req.op) {
    case StoreOp::kSet: {
      if (req.keys.size() != 1) return Reply::of(invalid_argument("store set: exactly one key, got {}", req.keys.size()));
      if (req.value.size() > kMaxValueBytes) {
        return Reply::of(resource_exhausted("store set: value of {} bytes exceeds {}", req.value.size(), kMaxValueBytes));
      }
      if (durable_) {
        Status s = durable_->kv_set(req.job_id, req.epoch, req.keys[0], req.value);
        if (!s.ok()) return Reply::of(s);
      }
      values_[Key{req.job_id, req.epoch, req.keys[0]}] = req.value;
      // Wake every waiter this set completes.
      for (auto it = waiters_.begin(); it != waiters_.end();) {
        if (it->req.job_id == req.job_id && it->req.epoch == req.epoch) {
          if (auto r = try_complete(it->req)) {
            ready_.emplace_back(it->token, std::move(*r));
            it = waiters_.erase(it);
            continue;
          }
        }
        ++it;
      }
      return Reply{};
    }
    case StoreOp::kContains: {
      Reply r;
      r.data.push_back(lookup(req.job_id, req.epoch, req.keys[0]) ? '1' : '0');
      return r;
    }
    case StoreOp::kGet:
    case StoreOp::kWait: {
      if (req.op == StoreOp::kGet && req.keys.size() != 1) {
        return Reply::of(invalid_argument("store get: exactly one key, got {}", req.keys.size()));
      }
      if (auto r = try_complete(req)) return r;
      waiters_.push_back(Waiter{token, req, now + std::chrono::milliseconds(std::max(0, req.timeout_ms))});
      return std::nullopt;
    }
  }
  return Reply::of(invalid_argument("store: unknown op"));
}

std::vector<std::pair<uint64_t, Reply>> RendezvousTable::take_ready(Clock::time_point now) {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (now >= it->deadline) {
      std::vector<std::string> missing;
      for (const auto& k : it->req.keys) {
        if (!lookup(it->req.job_id, it->req.epoch, k)) missing.push_back(k);
      }
      std::string list;
      for (const auto& k : missing) {
        if (!list.empty()) list.append(", ");
        list.append(k);
      }
      ready_.emplace_back(it->token, Reply::of(deadline_exceeded("store: job {} epoch {}: keys not set after {} ms: {}",
                                                                 it->req.job_id, it->req.epoch, it->req.timeout_ms,
                                                                 list)));
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
  return std::exchange(ready_, {});
}

void RendezvousTable::drop_job(const std::string& job_id) {
  for (auto it = values_.begin(); it != values_.end();) {
    it = std::get<0>(it->first) == job_id ? values_.erase(it) : std::next(it);
  }
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (it->req.job_id == job_id) {
      ready_.emplace_back(it->token, Reply::of(cancelled("store: job {} ended", job_id)));
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
  if (durable_) durable_->kv_drop_job(job_id).ignore();
}

}  // namespace troupe::sched
