// comm/rendezvous_store.cc — StoreNamespace, PrefixStore, FileStore and MemoryStore.
#include "comm/rendezvous_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

namespace troupe::comm {

namespace fs = std::filesystem;

std::string StoreNamespace::prefix() const { return fmt::format("{}/e{}/", job, epoch); }

std::string StoreNamespace::key(std::string_view name) const {
  return prefix() + std::string(name);
}

PrefixStore::PrefixStore(RendezvousStore& base, std::string prefix)
    : base_(base), prefix_(std::move(prefix)) {}

Status PrefixStore::set(std::string_view key, std::string_view value) {
  return base_.set(prefix_ + std::string(key), value);
}

Result<std::string> PrefixStore::get(std::string_view key, Deadline deadline) {
  return base_.get(prefix_ + std::string(key), deadline);
}

Status PrefixStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(prefix_ + k);
  return base_.wait(full, deadline);
}

Result<bool> PrefixStore::contains(std::string_view key) {
  return base_.contains(prefix_ + std::string(key));
}

Result<std::unique_ptr<FileStore>> FileStore::open(const fs::path& root) {
  if (root.empty()) return invalid_argument("FileStore: empty root directory");
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return io_error("FileStore: cannot create {}: {}", root.string(), ec.message());
  if (!fs::is_directory(root)) return invalid_argument("FileStore: {} is not a directory", root.string());
  return std::unique_ptr<FileStore>(new FileStore(root));
}

Result<fs::path> FileStore::path_of(std::string_view key) const {
  if (key.empty()) return invalid_argument("rendezvous key is empty");
  std::string name;
  name.reserve(key.size() + 8);
  for (unsigned char c : key) {
    if (c < 0x20 || c == 0x7f) return invalid_argument("rendezvous key has a control character: {}", std::string(key));
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-') {
      name.push_back(static_cast<char>(c));
    } else {
      name += fmt::format("%{:02X}", c);
    }
  }
  if (name.size() > 240) return invalid_argument("rendezvous key too long ({} bytes escaped)", name.size());
  // A leading '.' would collide with our temporary files.
  return root_ / ("k" + name);
}

Status FileStore::set(std::string_view key, std::string_view value) {
  TROUPE_ASSIGN_OR_RETURN(fs::path path, path_of(key));
  static std::atomic<uint64_t> counter{0};
  fs::path tmp = root_ / fmt::format(".tmp.{}.{}.{}", ::getpid(), counter.fetch_add(1),
                                      path.filename().string().substr(0, 64));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("FileStore: open {}: {}", tmp.string(), std::strerror(errno));
  size_t done = 0;
  while (done < value.size()) {
    ssize_t n = ::write(fd, value.data() + done, value.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return io_error("FileStore: write {}: {}", tmp.string(), std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return io_error("FileStore: close {}: {}", tmp.string(), std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return io_error("FileStore: rename to {}: {}", path.string(), std::strerror(err));
  }
  return ok_status();
}

Result<bool> FileStore::contains(std::string_view key) {
  TROUPE_ASSIGN_OR_RETURN(fs::path path, path_of(key));
  std::error_code ec;
  bool exists = fs::exists(path, ec);
  if (ec) return io_error("FileStore: stat {}: {}", path.string(), ec.message());
  return exists;
}

namespace {
// Sleeps a growing interval (1 ms .. 20 ms) without passing `deadline`.
void poll_sleep(std::chrono::microseconds& interval, Deadline deadline) {
  auto now = Clock::now();
  if (now >= deadline) return;
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
  std::this_thread::sleep_for(std::min(interval, left));
  interval = std::min(interval * 2, std::chrono::microseconds(20000));
}
}  // namespace

Result<std::string> FileStore::get(std::string_view key, Deadline deadline) {
  TROUPE_ASSIGN_OR_RETURN(fs::path path, path_of(key));
  std::chrono::microseconds interval(1000);
  for (;;) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      std::string out;
      char buf[65536];
      for (;;) {
        ssize_t n = ::read(fd, buf, sizeof(buf));
        if (n < 0) {
          if (errno == EINTR) continue;
          int err = errno;
          ::close(fd);
          return io_error("FileStore: read {}: {}", path.string(), std::strerror(err));
        }
        if (n == 0) break;
        out.append(buf, static_cast<size_t>(n));
      }
      ::close(fd);
      return out;
    }
    if (errno != ENOENT) return io_error("FileStore: open {}: {}", path.string(), std::strerror(errno));
    if (Clock::now() >= deadline) {
      return deadline_exceeded("rendezvous key '{}' not set before the deadline", key);
    }
    poll_sleep(interval, deadline);
  }
}

Status FileStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  std::chrono::microseconds interval(1000);
  size_t next = 0;  // keys before `next` were seen already
  for (;;) {
    while (next < keys.size()) {
      TROUPE_ASSIGN_OR_RETURN(bool present, contains(keys[next]));
      if (!present) break;
      ++next;
    }
    if (next == keys.size()) return ok_status();
    if (Clock::now() >= deadline) {
      std::string missing;
      for (size_t i = next; i < keys.size() && i < next + 4; ++i) {
        missing += (missing.empty() ? "" : ", ") + keys[i];
      }
      return deadline_exceeded("rendezvous keys not set before the deadline: {}{}", missing,
                               keys.size() - next > 4 ? ", ..." : "");
    }
    poll_sleep(interval, deadline);
  }
}

// ---- MemoryStore ----------------------------------------------------------------------

namespace {
Status check_key(std::string_view key) {
  if (key.empty()) return invalid_argument("rendezvous key is empty");
  for (unsigned char c : key) {
    if (c < 0x20 || c == 0x7f)
      return invalid_argument("rendezvous key has a control character: {}", std::string(key));
  }
  return ok_status();
}
}  // namespace

Status MemoryStore::set(std::string_view key, std::string_view value) {
  TROUPE_RETURN_IF_ERROR(check_key(key));
  {
    std::lock_guard lock(mu_);
    values_.insert_or_assign(std::string(key), std::string(value));
  }
  changed_.notify_all();
  return ok_status();
}

Result<std::string> MemoryStore::get(std::string_view key, Deadline deadline) {
  TROUPE_RETURN_IF_ERROR(check_key(key));
  std::unique_lock lock(mu_);
  while (true) {
    if (auto it = values_.find(key); it != values_.end()) return it->second;
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout &&
        values_.find(key) == values_.end()) {
      return deadline_exceeded("rendezvous key '{}' not set before the deadline", key);
    }
  }
}

Status MemoryStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  for (const auto& k : keys) TROUPE_RETURN_IF_ERROR(check_key(k));
  std::unique_lock lock(mu_);
  while (true) {
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (values_.find(k) == values_.end()) missing.push_back(k);
    }
    if (missing.empty()) return ok_status();
    if (Clock::now() >= deadline) {
      std::string names;
      for (size_t i = 0; i < missing.size() && i < 4; ++i) names += (i ? ", " : "") + missing[i];
      return deadline_exceeded("rendezvous keys not set before the deadline: {}{}", names,
                               missing.size() > 4 ? ", ..." : "");
    }
    changed_.wait_until(lock, deadline);
  }
}

Result<bool> MemoryStore::contains(std::string_view key) {
  TROUPE_RETURN_IF_ERROR(check_key(key));
  std::lock_guard lock(mu_);
  return values_.find(key) != values_.end();
}

}  // namespace troupe::comm
