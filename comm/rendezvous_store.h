// comm/rendezvous_store.h — defines RendezvousStore (the key-value store every data-plane
// backend meets its peers through), StoreNamespace (job/epoch key prefixes), PrefixStore
// (a namespaced view of a store), FileStore (a store in a directory) and MemoryStore (a
// store in this process's memory).
//
// The scheduler implements RendezvousStore over its control plane; comm never includes
// scheduler code. FileStore serves tests and single-host runs: a directory on a filesystem
// every rank sees, one file per key, written to a temporary name and renamed so a reader
// never sees a half-written value. MemoryStore serves a job whose driver and worker share
// one process (a 1x1x1 training run): no file, no socket, waits woken at once by set().
//
// Contract for every implementation:
// - set() overwrites; after it returns, get()/wait() on any rank eventually see the value.
// - get() and wait() block until the keys exist or the deadline passes
//   (kDeadlineExceeded naming the missing keys); they never hang past the deadline.
// - Keys are non-empty printable strings; '/' separates namespace parts.
// Thread safety: implementations are safe to call from several threads.
#pragma once

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace troupe::comm {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// A deadline `d` from now.
inline Deadline deadline_in(std::chrono::milliseconds d) { return Clock::now() + d; }

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;

  virtual Status set(std::string_view key, std::string_view value) = 0;
  // Blocks until `key` exists or `deadline` passes.
  virtual Result<std::string> get(std::string_view key, Deadline deadline) = 0;
  // Blocks until every key exists or `deadline` passes.
  virtual Status wait(const std::vector<std::string>& keys, Deadline deadline) = 0;
  // Non-blocking probe.
  virtual Result<bool> contains(std::string_view key) = 0;
};

// Key namespace of one job's communicators in one membership epoch:
// "<job>/e<epoch>/<name>". A rebuild after a failure uses epoch + 1, so no key of the
// failed epoch can be mistaken for a fresh one.
struct StoreNamespace {
  std::string job;
  uint64_t epoch = 0;

  std::string prefix() const;                       // "<job>/e<epoch>/"
  std::string key(std::string_view name) const;     // prefix() + name
};

// A view of `base` that prepends `prefix` to every key. Does not own `base`.
class PrefixStore final : public RendezvousStore {
 public:
  PrefixStore(RendezvousStore& base, std::string prefix);

  Status set(std::string_view key, std::string_view value) override;
  Result<std::string> get(std::string_view key, Deadline deadline) override;
  Status wait(const std::vector<std::string>& keys, Deadline deadline) override;
  Result<bool> contains(std::string_view key) override;

  const std::string& prefix() const { return prefix_; }

 private:
  RendezvousStore& base_;
  std::string prefix_;
};

// One file per key under `root` (created if missing). Each key maps to one file name
// (characters other than [A-Za-z0-9._-] are %XX-escaped, so '/' never makes a directory).
// Waiting polls the file system (1 ms growing to 20 ms): fine for rendezvous, not for
// data.
class FileStore final : public RendezvousStore {
 public:
  static Result<std::unique_ptr<FileStore>> open(const std::filesystem::path& root);

  Status set(std::string_view key, std::string_view value) override;
  Result<std::string> get(std::string_view key, Deadline deadline) override;
  Status wait(const std::vector<std::string>& keys, Deadline deadline) override;
  Result<bool> contains(std::string_view key) override;

  const std::filesystem::path& root() const { return root_; }

 private:
  explicit FileStore(std::filesystem::path root) : root_(std::move(root)) {}
  Result<std::filesystem::path> path_of(std::string_view key) const;

  std::filesystem::path root_;
};

// Keys and values in this process's memory, for the threads of one process (the driver and
// the worker of a one-process run). Keys are checked as FileStore checks them (non-empty,
// no control characters), so a key that works here works on every store. get() and wait()
// sleep on a condition variable that set() notifies: no polling.
class MemoryStore final : public RendezvousStore {
 public:
  Status set(std::string_view key, std::string_view value) override;
  Result<std::string> get(std::string_view key, Deadline deadline) override;
  Status wait(const std::vector<std::string>& keys, Deadline deadline) override;
  Result<bool> contains(std::string_view key) override;

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::string, std::less<>> values_;
};

}  // namespace troupe::comm
