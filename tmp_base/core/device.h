// core/device.h — defines Device (cpu, or cuda:i) and its parsing and printing.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

#include "core/status.h"

namespace troupe {

enum class DeviceType : uint8_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int i) { return {DeviceType::kCUDA, i}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  std::string to_string() const;
  // Accepts "cpu", "cuda", "cuda:3".
  static Result<Device> parse(std::string_view s);

  friend bool operator==(const Device&, const Device&) = default;
};

}  // namespace troupe

template <>
struct fmt::formatter<troupe::Device> : fmt::formatter<std::string> {
  template <typename Ctx>
  auto format(const troupe::Device& d, Ctx& ctx) const {
    return fmt::formatter<std::string>::format(d.to_string(), ctx);
  }
};
