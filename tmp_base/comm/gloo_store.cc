// comm/gloo_store.cc — GlooStore: gloo::rendezvous::Store calls mapped onto RendezvousStore.
#include "comm/gloo_store.h"

#include <gloo/common/error.h>

namespace troupe::comm {

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  Status st = store_.set(key, std::string_view(data.data(), data.size()));
  if (!st.ok()) throw gloo::IoException("rendezvous set failed: " + st.to_string());
}

std::vector<char> GlooStore::get(const std::string& key) {
  Result<std::string> r = store_.get(key, deadline_in(timeout_));
  if (!r.ok()) throw gloo::IoException("rendezvous get failed: " + r.status().to_string());
  return std::vector<char>(r->begin(), r->end());
}

void GlooStore::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout_);
}

void GlooStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  // Gloo passes kNoTimeout (0) or its default; never wait longer than our own bound.
  auto t = (timeout.count() <= 0 || timeout > timeout_) ? timeout_ : timeout;
  Status st = store_.wait(keys, deadline_in(t));
  if (!st.ok()) throw gloo::IoException("rendezvous wait failed: " + st.to_string());
}

}  // namespace troupe::comm
