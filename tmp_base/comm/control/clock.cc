// comm/control/clock.cc — os_random.
#include "comm/control/clock.h"

#include <random>

namespace troupe {

RandomSource os_random() {
  std::random_device rd;
  uint64_t seed = (uint64_t{rd()} << 32) ^ rd();
  return seeded_random(seed);
}

}  // namespace troupe
