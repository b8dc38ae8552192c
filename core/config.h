// core/config.h — defines ConfigTable, a strict reader over a TOML table (toml++):
// typed getters with defaults, errors that name the key and the file, and a final
// check that rejects every key nobody read ("unknown key 'model.n_layr'").
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"

namespace toml {
inline namespace v3 {
class table;
}
}  // namespace toml

namespace troupe {

class ConfigTable {
 public:
  // Parses a file / a string. Errors name the file, line and column.
  static Result<ConfigTable> parse_file(const std::string& path);
  static Result<ConfigTable> parse_string(const std::string& text, const std::string& source_name = "<string>");

  ConfigTable(ConfigTable&&) noexcept;
  ConfigTable& operator=(ConfigTable&&) noexcept;
  ~ConfigTable();

  // Typed reads. `key` may be dotted ("model.d_model"). A missing key gives the default;
  // a wrong type gives InvalidArgument naming the key, expected type and source.
  Result<int64_t> get_int(const std::string& key, std::optional<int64_t> dflt = std::nullopt);
  Result<double> get_double(const std::string& key, std::optional<double> dflt = std::nullopt);
  Result<bool> get_bool(const std::string& key, std::optional<bool> dflt = std::nullopt);
  Result<std::string> get_string(const std::string& key, std::optional<std::string> dflt = std::nullopt);
  Result<std::vector<int64_t>> get_int_list(const std::string& key, std::optional<std::vector<int64_t>> dflt = std::nullopt);
  bool has(const std::string& key) const;

  // Sets (or overrides) a value, as from a command line "--set model.d_model=64".
  Status set_from_string(const std::string& assignment);

  // InvalidArgument naming every key present in the file that no getter read.
  Status check_all_keys_used() const;
  const std::string& source() const { return source_; }
  // Where `key`'s value comes from, for error messages: "override 'k=v'" when an
  // override (set_from_string: --set, --parallel) gave it, else source().
  std::string origin(const std::string& key) const;

 private:
  ConfigTable();
  std::unique_ptr<toml::table> table_;
  std::string source_;
  std::set<std::string> used_;
  std::map<std::string, std::string> overrides_;  // key -> the override that set it
};

}  // namespace troupe
