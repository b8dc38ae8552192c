// core/parallel_layout.cc — ParallelLayout: validation, parsing, rank arithmetic, groups.
#include "core/parallel_layout.h"

#include <charconv>
#include <limits>

#include "core/check.h"

namespace troupe {
namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

Status check_part(std::string_view name, int64_t v) {
  if (v < 1) return invalid_argument("{} must be >= 1, got {}", name, v);
  if (v > kIntMax) return invalid_argument("{} = {} is too large (at most {})", name, v, kIntMax);
  return ok_status();
}

// A layout value: a decimal integer >= 1 that fits an int.
Result<int> parse_part(std::string_view text, std::string_view name, std::string_view value) {
  int64_t v = 0;
  const char* end = value.data() + value.size();
  auto [p, ec] = std::from_chars(value.data(), end, v);
  if (ec == std::errc::result_out_of_range || (ec == std::errc() && p == end && v > kIntMax)) {
    return invalid_argument("parallel layout '{}': {} = '{}' is too large (at most {})", text, name, value,
                            kIntMax);
  }
  if (ec != std::errc() || p != end) {
    return invalid_argument("parallel layout '{}': {} = '{}' is not an integer", text, name, value);
  }
  Status s = check_part(name, v);
  if (!s.ok()) return s.with_context(fmt::format("parallel layout '{}'", text));
  return static_cast<int>(v);
}

// Each factor is in [1, INT_MAX], so the partial products fit an int64 before each check.
Status check_world(int64_t pp, int64_t dp, int64_t n) {
  if (pp * dp > kIntMax || pp * dp * n > kIntMax) {
    return invalid_argument("world size pp*dp*n is too large (at most {} ranks)", kIntMax);
  }
  return ok_status();
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (;;) {
    const size_t pos = s.find(sep);
    out.push_back(s.substr(0, pos));
    if (pos == std::string_view::npos) return out;
    s.remove_prefix(pos + 1);
  }
}

}  // namespace

std::string ParallelCoord::to_string() const {
  return fmt::format("pp {}, dp {}, n {}", pp, dp, n);
}

Status ParallelLayout::validate(int64_t pp, int64_t dp, int64_t n) {
  Status s = check_part("pp", pp);
  if (s.ok()) s = check_part("dp", dp);
  if (s.ok()) s = check_part("n", n);
  if (s.ok()) s = check_world(pp, dp, n);
  return s.ok() ? s : s.with_context(fmt::format("parallel layout pp={},dp={},n={}", pp, dp, n));
}

ParallelLayout::ParallelLayout(int pp, int dp, int n) : pp_(pp), dp_(dp), n_(n) {
  const Status s = validate(pp, dp, n);
  TROUPE_CHECK(s.ok(), "{}", s.message());
}

Result<ParallelLayout> ParallelLayout::make(int64_t pp, int64_t dp, int64_t n) {
  TROUPE_RETURN_IF_ERROR(validate(pp, dp, n));
  return ParallelLayout(static_cast<int>(pp), static_cast<int>(dp), static_cast<int>(n));
}

Result<LayoutItems> parse_layout_items(std::string_view text) {
  LayoutItems items;
  if (text.empty())
    return invalid_argument("parallel layout: empty string (expected pp=P,dp=D,n=N or PxDxN)");
  if (text.find('=') == std::string_view::npos) {
    const std::vector<std::string_view> parts = split(text, 'x');
    if (parts.size() != 3) {
      return invalid_argument("parallel layout '{}': expected pp=P,dp=D,n=N or PxDxN (e.g. 2x1x4)", text);
    }
    TROUPE_ASSIGN_OR_RETURN(items.pp, parse_part(text, "pp", parts[0]));
    TROUPE_ASSIGN_OR_RETURN(items.dp, parse_part(text, "dp", parts[1]));
    TROUPE_ASSIGN_OR_RETURN(items.n, parse_part(text, "n", parts[2]));
    return items;
  }
  std::vector<std::string_view> seen;
  for (std::string_view item : split(text, ',')) {
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0 || eq + 1 == item.size()) {
      return invalid_argument("parallel layout '{}': '{}' is not key=value", text, item);
    }
    const std::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    for (std::string_view k : seen) {
      if (k == key) return invalid_argument("parallel layout '{}': key '{}' given twice", text, key);
    }
    seen.push_back(key);
    std::optional<int>* dst = key == "pp"   ? &items.pp
                              : key == "dp" ? &items.dp
                              : key == "n"  ? &items.n
                                            : nullptr;
    if (dst == nullptr) {
      items.other.emplace_back(std::string(key), std::string(value));
      continue;
    }
    TROUPE_ASSIGN_OR_RETURN(*dst, parse_part(text, key, value));
  }
  return items;
}

Result<ParallelLayout> ParallelLayout::parse(std::string_view text) {
  TROUPE_ASSIGN_OR_RETURN(LayoutItems items, parse_layout_items(text));
  if (!items.other.empty()) {
    return invalid_argument("parallel layout '{}': unknown key '{}' (known: pp, dp, n)", text,
                            items.other.front().first);
  }
  const int pp = items.pp.value_or(1), dp = items.dp.value_or(1), n = items.n.value_or(1);
  Status s = check_world(pp, dp, n);
  if (!s.ok()) return s.with_context(fmt::format("parallel layout '{}'", text));
  return ParallelLayout(pp, dp, n);
}

Status ParallelLayout::check_rank(int rank) const {
  if (rank < 0 || rank >= world_size()) {
    return out_of_range("rank {} outside layout {} of {} ranks", rank, to_string(), world_size());
  }
  return ok_status();
}

Status ParallelLayout::check_coord(const ParallelCoord& c) const {
  if (c.pp < 0 || c.pp >= pp_ || c.dp < 0 || c.dp >= dp_ || c.n < 0 || c.n >= n_) {
    return out_of_range("coordinates ({}) outside layout {}", c.to_string(), to_string());
  }
  return ok_status();
}

ParallelCoord ParallelLayout::coord(int rank) const {
  TROUPE_CHECK(rank >= 0 && rank < world_size(), "rank {} outside layout {}", rank, to_string());
  return ParallelCoord{rank / (dp_ * n_), (rank / n_) % dp_, rank % n_};
}

int ParallelLayout::rank_of(const ParallelCoord& c) const {
  TROUPE_CHECK(c.pp >= 0 && c.pp < pp_ && c.dp >= 0 && c.dp < dp_ && c.n >= 0 && c.n < n_,
               "coordinates ({}) outside layout {}", c.to_string(), to_string());
  return (c.pp * dp_ + c.dp) * n_ + c.n;
}

std::vector<int> ParallelLayout::dp_group(int rank) const {
  const ParallelCoord c = coord(rank);
  std::vector<int> g;
  for (int d = 0; d < dp_; ++d) g.push_back(rank_of({c.pp, d, c.n}));
  return g;
}

std::vector<int> ParallelLayout::n_group(int rank) const {
  const ParallelCoord c = coord(rank);
  std::vector<int> g;
  for (int i = 0; i < n_; ++i) g.push_back(rank_of({c.pp, c.dp, i}));
  return g;
}

std::vector<int> ParallelLayout::pp_group(int rank) const {
  const ParallelCoord c = coord(rank);
  std::vector<int> g;
  for (int p = 0; p < pp_; ++p) g.push_back(rank_of({p, c.dp, c.n}));
  return g;
}

std::optional<int> ParallelLayout::prev_stage(int rank) const {
  const ParallelCoord c = coord(rank);
  if (c.pp == 0) return std::nullopt;
  return rank_of({c.pp - 1, c.dp, c.n});
}

std::optional<int> ParallelLayout::next_stage(int rank) const {
  const ParallelCoord c = coord(rank);
  if (c.pp + 1 == pp_) return std::nullopt;
  return rank_of({c.pp + 1, c.dp, c.n});
}

std::string ParallelLayout::dp_group_name(int rank) const {
  const ParallelCoord c = coord(rank);
  return fmt::format("dp.pp{}.n{}", c.pp, c.n);
}

std::string ParallelLayout::n_group_name(int rank) const {
  const ParallelCoord c = coord(rank);
  return fmt::format("n.pp{}.dp{}", c.pp, c.dp);
}

std::string ParallelLayout::pp_group_name(int rank) const {
  const ParallelCoord c = coord(rank);
  return fmt::format("pp.dp{}.n{}", c.dp, c.n);
}

std::string ParallelLayout::to_string() const {
  return fmt::format("pp={},dp={},n={}", pp_, dp_, n_);
}

}  // namespace troupe
