// core/device.cc — Device parsing and printing.
#include "core/device.h"

#include <charconv>

namespace troupe {

std::string Device::to_string() const {
  return is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", index);
}

Result<Device> Device::parse(std::string_view s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.starts_with("cuda:")) {
    int i = -1;
    auto tail = s.substr(5);
    auto [p, ec] = std::from_chars(tail.data(), tail.data() + tail.size(), i);
    if (ec == std::errc() && p == tail.data() + tail.size() && i >= 0) return Device::cuda(i);
  }
  return invalid_argument("bad device '{}': expected cpu, cuda or cuda:N", s);
}

}  // namespace troupe
