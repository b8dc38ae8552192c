// core/logging.cc — spdlog set-up shared by every Troupe process.
#include "core/logging.h"

#include <spdlog/cfg/env.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <mutex>

namespace troupe {
namespace {
std::mutex g_mu;
std::vector<spdlog::sink_ptr>& sinks() {
  static std::vector<spdlog::sink_ptr> s{std::make_shared<spdlog::sinks::stderr_color_sink_mt>()};
  return s;
}
}  // namespace

void init_logging(const LoggingOptions& opts) {
  std::lock_guard lock(g_mu);
  auto& s = sinks();
  s.clear();
  s.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (!opts.file.empty()) s.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(opts.file));
  const std::string tag = opts.process_tag.empty() ? "" : "[" + opts.process_tag + "] ";
  spdlog::drop_all();
  auto def = std::make_shared<spdlog::logger>("troupe", s.begin(), s.end());
  spdlog::set_default_logger(def);
  spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%L%$ " + tag + "%n: %v");
  spdlog::set_level(opts.level);
  spdlog::flush_on(spdlog::level::warn);
  spdlog::cfg::load_env_levels();
}

std::shared_ptr<spdlog::logger> make_logger(const std::string& component) {
  std::lock_guard lock(g_mu);
  if (auto l = spdlog::get(component)) return l;
  auto& s = sinks();
  auto l = std::make_shared<spdlog::logger>(component, s.begin(), s.end());
  spdlog::initialize_logger(l);
  return l;
}

}  // namespace troupe
