// training/checkpointing/snapshot_ledger.cc — SnapshotLedger (snapshot_ledger.h).
#include "training/checkpointing/snapshot_ledger.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

namespace troupe::training {

namespace {
// Committed snapshots kept: what the keepers can still hold (two generations per rank).
constexpr size_t kCommittedKept = 2;
}  // namespace

nlohmann::json SnapshotRecord::to_json() const {
  nlohmann::json parts_j = nlohmann::json::array();
  for (const SnapshotPartRecord& p : parts) {
    parts_j.push_back({{"node", p.node},
                       {"endpoint", p.endpoint},
                       {"xxh64", p.xxh64},
                       {"bytes", p.bytes},
                       {"copy", p.copy_endpoint}});
  }
  nlohmann::json j{
      {"step", step},     {"epoch", epoch},           {"dp", dp},        {"grad_accum", grad_accum},
      {"tokens", tokens}, {"checkpoint", checkpoint}, {"parts", parts_j}};
  if (!unusable.empty()) j["unusable"] = unusable;
  return j;
}

Result<SnapshotRecord> SnapshotRecord::from_json(const nlohmann::json& j) {
  try {
    SnapshotRecord r;
    r.step = j.at("step").get<int64_t>();
    r.epoch = j.at("epoch").get<uint64_t>();
    r.dp = j.at("dp").get<int64_t>();
    r.grad_accum = j.at("grad_accum").get<int64_t>();
    r.tokens = j.value("tokens", int64_t{0});
    r.checkpoint = j.value("checkpoint", false);
    r.unusable = j.value("unusable", "");
    for (const auto& p : j.at("parts")) {
      SnapshotPartRecord pr;
      pr.landed = true;
      pr.node = p.at("node").get<std::string>();
      pr.endpoint = p.at("endpoint").get<std::string>();
      pr.xxh64 = p.at("xxh64").get<uint64_t>();
      pr.bytes = p.value("bytes", uint64_t{0});
      pr.copy_endpoint = p.value("copy", "");
      r.parts.push_back(std::move(pr));
    }
    r.committed = true;
    if (r.step < 0 || r.dp < 1 || r.grad_accum < 1 || r.parts.empty())
      return data_loss("snapshot record of step {}: inconsistent", r.step);
    return r;
  } catch (const std::exception& e) {
    return data_loss("snapshot record: {}", e.what());
  }
}

std::vector<PartSource> SnapshotRecord::sources() const {
  std::vector<PartSource> out;
  for (const SnapshotPartRecord& p : parts) {
    PartSource s;
    if (!p.endpoint.empty()) s.endpoints.push_back(p.endpoint);
    if (!p.copy_endpoint.empty()) s.endpoints.push_back(p.copy_endpoint);
    s.xxh64 = p.xxh64;
    out.push_back(std::move(s));
  }
  return out;
}

int64_t SnapshotRecord::bytes() const {
  int64_t b = 0;
  for (const SnapshotPartRecord& p : parts) b += static_cast<int64_t>(p.bytes);
  return b;
}

std::optional<int64_t> SnapshotLedger::landed(const SnapshotLanded& l, uint64_t epoch, int world, int64_t dp,
                                              int64_t grad_accum) {
  if (l.epoch != epoch || l.rank < 0 || l.rank >= world || l.step < 0) return std::nullopt;
  SnapshotRecord& r = records_[l.step];
  if (r.committed && r.epoch == epoch) return std::nullopt;  // a late duplicate
  // A step run again after a rewind makes a new snapshot of it: the old record goes.
  if (r.committed || r.parts.size() != static_cast<size_t>(world) || r.epoch != epoch) {
    r = SnapshotRecord{};
    r.step = l.step;
    r.epoch = epoch;
    r.dp = dp;
    r.grad_accum = grad_accum;
    r.parts.assign(static_cast<size_t>(world), SnapshotPartRecord{});
  }
  if (!l.error.empty()) {
    r.unusable = fmt::format("rank {}: {}", l.rank, l.error);
    return std::nullopt;
  }
  SnapshotPartRecord& p = r.parts[static_cast<size_t>(l.rank)];
  p.landed = true;
  p.node = l.node;
  p.endpoint = l.endpoint;
  p.xxh64 = l.xxh64;
  p.bytes = l.bytes;
  const bool all =
      std::all_of(r.parts.begin(), r.parts.end(), [](const SnapshotPartRecord& x) { return x.landed; });
  if (!all || !r.unusable.empty()) return std::nullopt;
  return l.step;
}

SnapshotCommitted SnapshotLedger::commit(int64_t step, int64_t tokens, bool checkpoint) {
  SnapshotRecord& r = records_.at(step);
  r.committed = true;
  r.tokens = tokens;
  r.checkpoint = checkpoint;
  // Copy targets: the nodes with a reachable keeper, in name order, each to the next.
  std::map<std::string, std::string> nodes;
  for (const SnapshotPartRecord& p : r.parts) {
    if (!p.endpoint.empty()) nodes.emplace(p.node, p.endpoint);
  }
  SnapshotCommitted c;
  c.epoch = r.epoch;
  c.step = step;
  c.checkpoint = checkpoint;
  if (nodes.size() >= 2) {
    for (auto it = nodes.begin(); it != nodes.end(); ++it) {
      auto next = std::next(it) == nodes.end() ? nodes.begin() : std::next(it);
      c.copy_to.emplace_back(it->first, next->second);
    }
  }
  for (SnapshotPartRecord& p : r.parts) {
    for (const auto& [node, ep] : c.copy_to) {
      if (node == p.node) p.copy_endpoint = ep;
    }
  }
  // Older snapshots beyond what the keepers hold go, and incomplete older ones.
  std::vector<int64_t> gone;
  size_t kept = 1;  // this one
  for (auto it = records_.rbegin(); it != records_.rend(); ++it) {
    if (it->first >= step) continue;
    if (!it->second.committed || ++kept > kCommittedKept) gone.push_back(it->first);
  }
  for (int64_t s : gone) records_.erase(s);
  return c;
}

SnapshotCommitted SnapshotLedger::recommit(int64_t step, uint64_t epoch, bool checkpoint) const {
  SnapshotCommitted c;
  c.epoch = epoch;
  c.step = step;
  c.checkpoint = checkpoint;
  if (const SnapshotRecord* r = find(step)) {
    std::map<std::string, std::string> to;
    for (const SnapshotPartRecord& p : r->parts) {
      if (!p.copy_endpoint.empty()) to.emplace(p.node, p.copy_endpoint);
    }
    c.copy_to.assign(to.begin(), to.end());
  }
  return c;
}

const SnapshotRecord* SnapshotLedger::newest_usable(int64_t step) const {
  for (auto it = records_.rbegin(); it != records_.rend(); ++it) {
    if (it->first <= step && it->second.committed && it->second.unusable.empty()) return &it->second;
  }
  return nullptr;
}

const SnapshotRecord* SnapshotLedger::find(int64_t step) const {
  auto it = records_.find(step);
  return it == records_.end() ? nullptr : &it->second;
}

void SnapshotLedger::mark_unusable(int64_t step, const std::string& why) {
  auto it = records_.find(step);
  if (it != records_.end() && it->second.unusable.empty()) it->second.unusable = why;
}

void SnapshotLedger::drop_incomplete() {
  std::erase_if(records_, [](const auto& kv) { return !kv.second.committed; });
}

nlohmann::json SnapshotLedger::committed_json() const {
  nlohmann::json out = nlohmann::json::array();
  for (auto it = records_.rbegin(); it != records_.rend(); ++it) {
    if (it->second.committed) out.push_back(it->second.to_json());
  }
  return out;
}

Result<SnapshotLedger> SnapshotLedger::from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_array())
    return data_loss("the job's snapshot records are not a JSON array: {}", text.substr(0, 200));
  SnapshotLedger l;
  for (const auto& e : j) {
    TROUPE_ASSIGN_OR_RETURN(SnapshotRecord r, SnapshotRecord::from_json(e));
    l.records_[r.step] = std::move(r);
  }
  return l;
}

int64_t SnapshotLedger::newest_committed() const {
  for (auto it = records_.rbegin(); it != records_.rend(); ++it) {
    if (it->second.committed) return it->first;
  }
  return -1;
}

}  // namespace troupe::training
