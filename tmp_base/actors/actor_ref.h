// actors/actor_ref.h — defines ActorRef, the address of an actor anywhere in the
// cluster ("node/name"), and TypedActorRef<Ms...>, an ActorRef that also states at
// compile time which messages the actor accepts.
//
// An ActorRef is a plain value: copy it, store it, put it in a message (to_string /
// parse). Local and remote actors are addressed the same way; the ActorSystem decides
// at send time whether the node is this process or a peer.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <type_traits>

#include "comm/control/envelope.h"
#include "core/status.h"

namespace troupe::actors {

class ActorRef {
 public:
  ActorRef() = default;
  ActorRef(std::string node, std::string name) : addr_{std::move(node), std::move(name)} {}
  explicit ActorRef(control::ActorAddress addr) : addr_(std::move(addr)) {}

  // "node/name" -> ActorRef. Both parts non-empty, no further '/'.
  static Result<ActorRef> parse(std::string_view text);

  const std::string& node() const { return addr_.node; }
  const std::string& name() const { return addr_.name; }
  const control::ActorAddress& address() const { return addr_; }
  bool valid() const { return !addr_.node.empty() && !addr_.name.empty(); }
  std::string to_string() const { return addr_.to_string(); }

  friend bool operator==(const ActorRef& a, const ActorRef& b) { return a.addr_ == b.addr_; }
  friend bool operator<(const ActorRef& a, const ActorRef& b) { return a.addr_ < b.addr_; }

 private:
  control::ActorAddress addr_;
};

// An ActorRef whose accepted messages are part of its type: tell/ask through it
// fail to compile for a message outside `Ms...` (CAF's typed actor handles).
template <class... Ms>
class TypedActorRef {
 public:
  TypedActorRef() = default;
  explicit TypedActorRef(ActorRef ref) : ref_(std::move(ref)) {}
  const ActorRef& ref() const { return ref_; }
  operator const ActorRef&() const { return ref_; }  // NOLINT: a typed ref is a ref

  template <class M>
  static constexpr bool accepts = (std::is_same_v<M, Ms> || ...);

 private:
  ActorRef ref_;
};

}  // namespace troupe::actors

template <>
struct std::hash<troupe::actors::ActorRef> {
  size_t operator()(const troupe::actors::ActorRef& r) const {
    return std::hash<std::string>()(r.node()) * 31 + std::hash<std::string>()(r.name());
  }
};
