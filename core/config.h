// core/config.h — defines ConfigTable, a strict reader over a TOML table (toml++):
// typed getters with defaults, errors that name the key and the file, and a final
// check that rejects every key nobody read ("unknown key 'model.n_layr'"). Every read
// carries the key's one-line description: the table records (key, type, default,
// description) for each key read, which is what the configuration reference
// (docs/config.md, tools/config_doc_main.cc) is generated from.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace toml {
inline namespace v3 {
class table;
}
}  // namespace toml

namespace troupe {

// One key as a reader declared it: what docs/config.md lists.
struct ConfigKeyDoc {
  std::string key;           // dotted: "train.steps"
  std::string type;          // "integer", "number", "boolean", "string", "list of integers"
  std::string default_text;  // as TOML would write it; "(required)" when there is none
  std::string description;   // one line
};

class ConfigTable {
 public:
  // Parses a file / a string. Errors name the file, line and column.
  static Result<ConfigTable> parse_file(const std::string& path);
  static Result<ConfigTable> parse_string(const std::string& text, const std::string& source_name = "<string>");

  ConfigTable(ConfigTable&&) noexcept;
  ConfigTable& operator=(ConfigTable&&) noexcept;
  ~ConfigTable();

  // Typed reads. `key` may be dotted ("model.d_model"). A missing key gives the default
  // (nullopt: the key is required); a wrong type gives InvalidArgument naming the key,
  // expected type and source. `doc` is the key's one-line description for the reference;
  // `shown_default` replaces the printed default where it is derived from other keys
  // ("optim.lr / 10").
  Result<int64_t> get_int(const std::string& key, std::optional<int64_t> dflt, std::string_view doc,
                          std::string_view shown_default = {});
  Result<double> get_double(const std::string& key, std::optional<double> dflt, std::string_view doc,
                            std::string_view shown_default = {});
  Result<bool> get_bool(const std::string& key, std::optional<bool> dflt, std::string_view doc,
                        std::string_view shown_default = {});
  Result<std::string> get_string(const std::string& key, std::optional<std::string> dflt,
                                 std::string_view doc, std::string_view shown_default = {});
  Result<std::vector<int64_t>> get_int_list(const std::string& key, std::optional<std::vector<int64_t>> dflt,
                                            std::string_view doc, std::string_view shown_default = {});
  bool has(const std::string& key) const;
  // The keys present under `table` ("bench": "bench.overlap_a2a", ...), sorted.
  std::vector<std::string> keys_under(const std::string& table) const;

  // Every key read so far, in the order of first read, with its declaration.
  const std::vector<ConfigKeyDoc>& documented_keys() const { return docs_; }

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
  std::vector<ConfigKeyDoc> docs_;
  void document(const std::string& key, const char* type, std::string default_text, std::string_view doc,
                std::string_view shown_default);
};

}  // namespace troupe
