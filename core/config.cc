// core/config.cc — ConfigTable over toml++.
#include "core/config.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include <algorithm>

namespace troupe {

ConfigTable::ConfigTable() : table_(std::make_unique<toml::table>()) {}
ConfigTable::ConfigTable(ConfigTable&&) noexcept = default;
ConfigTable& ConfigTable::operator=(ConfigTable&&) noexcept = default;
ConfigTable::~ConfigTable() = default;

Result<ConfigTable> ConfigTable::parse_string(const std::string& text, const std::string& source_name) {
  ConfigTable c;
  c.source_ = source_name;
  try {
    *c.table_ = toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    return invalid_argument("{}:{}:{}: {}", source_name, e.source().begin.line, e.source().begin.column,
                            e.description());
  }
  return c;
}

Result<ConfigTable> ConfigTable::parse_file(const std::string& path) {
  ConfigTable c;
  c.source_ = path;
  try {
    *c.table_ = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    if (e.source().begin.line == 0) return not_found("cannot read config {}: {}", path, e.description());
    return invalid_argument("{}:{}:{}: {}", path, e.source().begin.line, e.source().begin.column,
                            e.description());
  }
  return c;
}

namespace {
const toml::node* find(const toml::table& t, const std::string& key) {
  return t.at_path(key).node();
}

template <typename T>
Result<T> read_value(ConfigTable& self, const toml::table& t, std::set<std::string>& used,
                     const std::string& key, std::optional<T> dflt, const char* type_name) {
  used.insert(key);
  const std::string source = self.origin(key);
  const toml::node* n = find(t, key);
  if (n == nullptr) {
    if (dflt) return *dflt;
    return invalid_argument("{}: missing required key '{}' ({})", source, key, type_name);
  }
  if constexpr (std::is_same_v<T, double>) {
    if (auto v = n->value<double>()) return *v;  // toml++ converts integers too
  } else if constexpr (std::is_same_v<T, int64_t>) {
    if (n->is_integer()) return *n->value<int64_t>();
  } else if constexpr (std::is_same_v<T, bool>) {
    if (n->is_boolean()) return *n->value<bool>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (n->is_string()) return *n->value<std::string>();
  }
  return invalid_argument("{}: key '{}' must be {} (got {})", source, key, type_name,
                          fmt::format("{}", fmt::streamed(n->type())));
}

// A default as TOML writes it.
std::string toml_text(int64_t v) {
  return std::to_string(v);
}
std::string toml_text(double v) {
  return fmt::format("{}", v);
}
std::string toml_text(bool v) {
  return v ? "true" : "false";
}
std::string toml_text(const std::string& v) {
  return fmt::format("\"{}\"", v);
}
std::string toml_text(const std::vector<int64_t>& v) {
  return fmt::format("[{}]", fmt::join(v, ", "));
}

template <typename T>
std::string default_text(const std::optional<T>& d) {
  return d ? toml_text(*d) : std::string("(required)");
}

void collect_keys(const toml::table& t, const std::string& prefix, std::vector<std::string>& out) {
  for (auto&& [k, v] : t) {
    std::string name = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* sub = v.as_table()) {
      collect_keys(*sub, name, out);
    } else {
      out.push_back(name);
    }
  }
}
}  // namespace

void ConfigTable::document(const std::string& key, const char* type, std::string default_text,
                           std::string_view doc, std::string_view shown_default) {
  for (const ConfigKeyDoc& d : docs_) {
    if (d.key == key) return;  // the first read declares it
  }
  docs_.push_back(ConfigKeyDoc{key, type,
                               shown_default.empty() ? std::move(default_text) : std::string(shown_default),
                               std::string(doc)});
}

Result<int64_t> ConfigTable::get_int(const std::string& key, std::optional<int64_t> dflt,
                                     std::string_view doc, std::string_view shown_default) {
  document(key, "integer", default_text(dflt), doc, shown_default);
  return read_value<int64_t>(*this, *table_, used_, key, dflt, "an integer");
}
Result<double> ConfigTable::get_double(const std::string& key, std::optional<double> dflt,
                                       std::string_view doc, std::string_view shown_default) {
  document(key, "number", default_text(dflt), doc, shown_default);
  return read_value<double>(*this, *table_, used_, key, dflt, "a number");
}
Result<bool> ConfigTable::get_bool(const std::string& key, std::optional<bool> dflt, std::string_view doc,
                                   std::string_view shown_default) {
  document(key, "boolean", default_text(dflt), doc, shown_default);
  return read_value<bool>(*this, *table_, used_, key, dflt, "true or false");
}
Result<std::string> ConfigTable::get_string(const std::string& key, std::optional<std::string> dflt,
                                            std::string_view doc, std::string_view shown_default) {
  document(key, "string", default_text(dflt), doc, shown_default);
  return read_value<std::string>(*this, *table_, used_, key, dflt, "a string");
}

Result<std::vector<int64_t>> ConfigTable::get_int_list(const std::string& key,
                                                       std::optional<std::vector<int64_t>> dflt,
                                                       std::string_view doc, std::string_view shown_default) {
  document(key, "list of integers", default_text(dflt), doc, shown_default);
  used_.insert(key);
  const toml::node* n = find(*table_, key);
  if (n == nullptr) {
    if (dflt) return *dflt;
    return invalid_argument("{}: missing required key '{}' (a list of integers)", source_, key);
  }
  const toml::array* a = n->as_array();
  if (a == nullptr) return invalid_argument("{}: key '{}' must be a list of integers", origin(key), key);
  std::vector<int64_t> out;
  for (auto&& e : *a) {
    if (!e.is_integer()) return invalid_argument("{}: key '{}' must be a list of integers", origin(key), key);
    out.push_back(*e.value<int64_t>());
  }
  return out;
}

bool ConfigTable::has(const std::string& key) const { return find(*table_, key) != nullptr; }

std::vector<std::string> ConfigTable::keys_under(const std::string& table) const {
  std::vector<std::string> out;
  if (const toml::table* t = table_->at_path(table).as_table()) collect_keys(*t, table, out);
  std::sort(out.begin(), out.end());
  return out;
}

Status ConfigTable::set_from_string(const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    return invalid_argument("bad override '{}': expected key=value", assignment);
  }
  const std::string key = assignment.substr(0, eq);
  const std::string value = assignment.substr(eq + 1);
  // Parse the value as TOML so types follow TOML rules; bare words become strings.
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    try {
      parsed = toml::parse("v = \"" + value + "\"");
    } catch (const toml::parse_error& e) {
      return invalid_argument("bad value in override '{}': {}", assignment, e.description());
    }
  }
  // Walk/create intermediate tables.
  toml::table* t = table_.get();
  size_t start = 0;
  while (true) {
    size_t dot = key.find('.', start);
    if (dot == std::string::npos) break;
    std::string part = key.substr(start, dot - start);
    auto* sub = (*t)[part].as_table();
    if (sub == nullptr) {
      t->insert_or_assign(part, toml::table{});
      sub = (*t)[part].as_table();
    }
    t = sub;
    start = dot + 1;
  }
  t->insert_or_assign(key.substr(start), *parsed.get("v"));
  overrides_[key] = assignment;
  return ok_status();
}

Status ConfigTable::check_all_keys_used() const {
  std::vector<std::string> keys;
  collect_keys(*table_, "", keys);
  // Unknown keys by where they came from: the file, or each override that named one.
  std::vector<std::string> unknown_in_file;
  std::vector<std::string> problems;
  for (const auto& k : keys) {
    if (used_.count(k)) continue;
    if (auto it = overrides_.find(k); it != overrides_.end()) {
      problems.push_back(
          fmt::format("override '{}': unknown key '{}' (not a key of the config)", it->second, k));
    } else {
      unknown_in_file.push_back(k);
    }
  }
  if (!unknown_in_file.empty()) {
    problems.insert(problems.begin(),
                    fmt::format("{}: unknown key{} '{}'", source_, unknown_in_file.size() > 1 ? "s" : "",
                                fmt::join(unknown_in_file, "', '")));
  }
  if (problems.empty()) return ok_status();
  return invalid_argument("{}", fmt::join(problems, "; "));
}

std::string ConfigTable::origin(const std::string& key) const {
  auto it = overrides_.find(key);
  if (it == overrides_.end()) return source_;
  return fmt::format("override '{}'", it->second);
}

}  // namespace troupe
