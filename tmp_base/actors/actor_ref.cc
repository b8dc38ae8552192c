// actors/actor_ref.cc — ActorRef::parse.
#include "actors/actor_ref.h"

namespace troupe::actors {

Result<ActorRef> ActorRef::parse(std::string_view text) {
  const size_t slash = text.find('/');
  if (slash == std::string_view::npos || slash == 0 || slash + 1 == text.size() ||
      text.find('/', slash + 1) != std::string_view::npos) {
    return invalid_argument("actor ref '{}' is not of the form node/name", text);
  }
  if (slash > control::kMaxNameBytes || text.size() - slash - 1 > control::kMaxNameBytes) {
    return invalid_argument("actor ref '{}': node or name longer than {} bytes", text,
                            control::kMaxNameBytes);
  }
  return ActorRef(std::string(text.substr(0, slash)), std::string(text.substr(slash + 1)));
}

}  // namespace troupe::actors
