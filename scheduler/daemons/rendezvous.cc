// scheduler/daemons/rendezvous.cc — RendezvousTable.
#include "scheduler/daemons/rendezvous.h"

#include <algorithm>

namespace troupe::sched {

void RendezvousTable::load(const std::string& job, uint64_t epoch) {
  if (!durable_ || !loaded_.emplace(job, epoch).second) return;
  auto rows = durable_->kv_load(job, epoch);
  if (!rows.ok()) {
    loaded_.erase({job, epoch});  // try again on the next request
    return;
  }
  for (auto& [k, v] : *rows) values_.emplace(Key{job, epoch, std::move(k)}, std::move(v));
}

std::optional<std::string> RendezvousTable::lookup(const std::string& job, uint64_t epoch, const std::string& key) {
  load(job, epoch);
  auto it = values_.find(Key{job, epoch, key});
  if (it != values_.end()) return it->second;
  return std::nullopt;
}

Reply RendezvousTable::complete(const StoreRequest& req) {
  Reply r;
  if (req.op == StoreOp::kGet) r.data = values_.at(Key{req.job_id, req.epoch, req.keys[0]});
  return r;
}

void RendezvousTable::forget(uint64_t token, const Waiter& w) {
  deadlines_.erase({w.deadline, token});
  for (const auto& k : w.req.keys) {
    auto it = waiting_for_.find(Key{w.req.job_id, w.req.epoch, k});
    if (it == waiting_for_.end()) continue;
    std::erase(it->second, token);
    if (it->second.empty()) waiting_for_.erase(it);
  }
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
      load(req.job_id, req.epoch);
      Key key{req.job_id, req.epoch, req.keys[0]};
      auto [vit, inserted] = values_.insert_or_assign(key, req.value);
      if (!inserted) return Reply{};  // already set: nobody waits for it
      // Wake the requests this set completes: only those waiting for this key.
      auto wit = waiting_for_.find(key);
      if (wit == waiting_for_.end()) return Reply{};
      std::vector<uint64_t> tokens = std::move(wit->second);
      waiting_for_.erase(wit);
      for (uint64_t t : tokens) {
        auto it = waiters_.find(t);
        if (it == waiters_.end()) continue;
        size_t n = std::count(it->second.req.keys.begin(), it->second.req.keys.end(), req.keys[0]);
        it->second.missing -= std::min(it->second.missing, n);
        if (it->second.missing > 0) continue;
        ready_.emplace_back(t, complete(it->second.req));
        forget(t, it->second);
        waiters_.erase(it);
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
      load(req.job_id, req.epoch);
      Waiter w{req, now + std::chrono::milliseconds(std::max(0, req.timeout_ms)), 0};
      std::set<std::string> missing;
      for (const auto& k : req.keys) {
        if (!values_.count(Key{req.job_id, req.epoch, k})) missing.insert(k);
      }
      if (missing.empty()) return complete(req);
      for (const auto& k : req.keys) w.missing += missing.count(k);
      for (const auto& k : missing) waiting_for_[Key{req.job_id, req.epoch, k}].push_back(token);
      deadlines_.emplace(w.deadline, token);
      waiters_.emplace(token, std::move(w));
      return std::nullopt;
    }
  }
  return Reply::of(invalid_argument("store: unknown op"));
}

std::vector<std::pair<uint64_t, Reply>> RendezvousTable::take_ready(Clock::time_point now) {
  while (!deadlines_.empty() && now >= deadlines_.begin()->first) {
    const uint64_t token = deadlines_.begin()->second;
    auto it = waiters_.find(token);
    if (it == waiters_.end()) {
      deadlines_.erase(deadlines_.begin());
      continue;
    }
    const StoreRequest& req = it->second.req;
    std::string list;
    for (const auto& k : req.keys) {
      if (values_.count(Key{req.job_id, req.epoch, k})) continue;
      if (!list.empty()) list.append(", ");
      list.append(k);
    }
    ready_.emplace_back(
        token, Reply::of(deadline_exceeded("store: job {} epoch {}: keys not set after {} ms: {}", req.job_id,
                                           req.epoch, req.timeout_ms, list)));
    forget(token, it->second);
    waiters_.erase(it);
  }
  return std::exchange(ready_, {});
}

void RendezvousTable::drop_job(const std::string& job_id) {
  for (auto it = values_.begin(); it != values_.end();) {
    it = std::get<0>(it->first) == job_id ? values_.erase(it) : std::next(it);
  }
  for (auto it = loaded_.begin(); it != loaded_.end();) {
    it = it->first == job_id ? loaded_.erase(it) : std::next(it);
  }
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (it->second.req.job_id == job_id) {
      ready_.emplace_back(it->first, Reply::of(cancelled("store: job {} ended", job_id)));
      forget(it->first, it->second);
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
  if (durable_) durable_->kv_drop_job(job_id).ignore();
}

}  // namespace troupe::sched
