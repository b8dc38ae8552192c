// core/capnp_fields.h — defines the one struct <-> Cap'n Proto copier Troupe's codecs
// share. A codec names each field of a struct once, in a table
//
//   constexpr auto kActorStatus = capnp_codec::fields(TROUPE_CAPNP_FIELD(id, Id), ...);
//
// (the C++ member and the Cap'n Proto field's accessor stem: getId / setId / initId), and
// that one table drives both directions: write(builder, table, value) and
// read_into(reader, table, value). What is copied follows the member's C++ type:
//   - a number, bool or std::string: set / get (a std::string on a Data field as bytes);
//   - an enum (TROUPE_CAPNP_ENUM): as its integer; reading refuses a value past the last
//     enumerator named in the table (DataLoss naming the field), never casts it blindly;
//   - a std::vector of those: a Cap'n Proto list;
//   - a std::vector or std::map of structs (TROUPE_CAPNP_LIST, with the element's table;
//     a map's element is its key/value pair, read back last-wins): a list of structs;
//   - a struct (TROUPE_CAPNP_STRUCT, with its table; TROUPE_CAPNP_WHOLE when the value
//     itself is the struct or group): a nested struct or a group; an empty struct with no
//     table is a Void union member;
//   - a std::variant (a one_of table of alternatives instead of fields): a union, one
//     alternative per variant type with the union member that holds it; reading a member
//     no alternative names is DataLoss naming its number.
// join() concatenates tables, for structs that share a run of fields. Checks that are not
// about the wire (ranges of plain integers, sizes) stay with each codec, run on the decoded
// value. encode / decode frame a root message with core/capnp_io.h; TROUPE_CAPNP_CODEC
// defines a message's encode_x / decode_x pair with them. Header-only, for code that links
// CapnProto (C++17: see capnp_io.h).
#pragma once

#include <capnp/blob.h>
#include <capnp/list.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/capnp_io.h"
#include "core/status.h"

namespace troupe::capnp_codec {

struct NoTable {};  // a field of a number, string, list of those, or Void
inline constexpr NoTable kPlain{};
template <class E>
struct EnumLast {  // an enum field: its last valid enumerator
  E last;
};

// One field: `member` reaches it in the C++ value (m -> m.x, const or not); get / set /
// init / is are the Cap'n Proto accessors (getX / setX / initX / isX); `sub`
// is the table of its elements or members, NoTable, or EnumLast.
template <class Member, class Get, class Set, class Init, class Is, class Sub>
struct Field {
  Member member;
  Get get;
  Set set;
  Init init;
  Is is;  // isX(): a union member's "this one is set"
  Sub sub;
  const char* name;
};
template <class Member, class Get, class Set, class Init, class Is, class Sub>
constexpr Field<Member, Get, Set, Init, Is, Sub> make_field(Member m, Get g, Set s, Init i, Is is, Sub sub,
                                                            const char* name) {
  return {m, g, s, i, is, sub, name};
}

// The fields of a struct (a Table) or the alternatives of a union (a OneOf), in order.
template <bool kUnion, class... E>
struct Entries {
  std::tuple<E...> items;
};
template <class... F>
using Table = Entries<false, F...>;
template <class... A>
using OneOf = Entries<true, A...>;

template <class... F>
constexpr Table<F...> fields(F... f) {
  return {{f...}};
}
// The fields of `a` then those of `b`: for structs that share a run of fields.
template <class... A, class... B>
constexpr Table<A..., B...> join(const Table<A...>& a, const Table<B...>& b) {
  return {std::tuple_cat(a.items, b.items)};
}

// One alternative of a variant: the C++ type T and the field of the union that holds it
// (its generated isX() tells a reader which member is set).
template <class T, class F>
struct Alt {
  using value_type = T;
  F field;
};
template <class T, class F>
constexpr Alt<T, F> alt(F field) {
  return {field};
}
template <class... A>
constexpr OneOf<A...> one_of(A... a) {
  return {{a...}};
}

}  // namespace troupe::capnp_codec

// The accessors of Cap'n Proto field stem `Name` (getName / setName / initName / isName);
// generic, so only those a field's type uses are ever instantiated.
#define TROUPE_CAPNP_ACCESSORS_(Name)                                            \
  [](auto x) { return x.get##Name(); },                                          \
      [](auto x, auto&&... v) { x.set##Name(std::forward<decltype(v)>(v)...); }, \
      [](auto x, auto... n) { return x.init##Name(n...); }, [](auto x) { return x.is##Name(); }
#define TROUPE_CAPNP_MEMBER_(member) \
  [](auto& m) -> auto& {             \
    return m.member;                 \
  }
#define TROUPE_CAPNP_SELF_ \
  [](auto& m) -> auto& {   \
    return m;              \
  }

// C++ member `member` <-> Cap'n Proto field `Name`: a number, string or list of those.
#define TROUPE_CAPNP_FIELD(member, Name)                                                         \
  ::troupe::capnp_codec::make_field(TROUPE_CAPNP_MEMBER_(member), TROUPE_CAPNP_ACCESSORS_(Name), \
                                    ::troupe::capnp_codec::NoTable{}, #Name)
// An enum member whose valid values run up to `last`.
#define TROUPE_CAPNP_ENUM(member, Name, last)                                                    \
  ::troupe::capnp_codec::make_field(TROUPE_CAPNP_MEMBER_(member), TROUPE_CAPNP_ACCESSORS_(Name), \
                                    ::troupe::capnp_codec::EnumLast<decltype(last)>{last}, #Name)
// A vector or map member whose elements are structs described by `table`.
#define TROUPE_CAPNP_LIST(member, Name, table) \
  ::troupe::capnp_codec::make_field(TROUPE_CAPNP_MEMBER_(member), TROUPE_CAPNP_ACCESSORS_(Name), table, #Name)
// A struct member described by `table`, in a struct field or group `Name`.
#define TROUPE_CAPNP_STRUCT(member, Name, table) TROUPE_CAPNP_LIST(member, Name, table)
// The value itself in field or group `Name`: by `table`, or with capnp_codec::kPlain a
// list of numbers / strings (the value is a vector) or Void (the value is an empty struct).
#define TROUPE_CAPNP_WHOLE(Name, table) \
  ::troupe::capnp_codec::make_field(TROUPE_CAPNP_SELF_, TROUPE_CAPNP_ACCESSORS_(Name), table, #Name)

namespace troupe::capnp_codec {
namespace detail {

template <class T>
struct is_vector : std::false_type {};
template <class E, class A>
struct is_vector<std::vector<E, A>> : std::true_type {};
template <class T>
struct is_map : std::false_type {};
template <class K, class V, class C, class A>
struct is_map<std::map<K, V, C, A>> : std::true_type {
  using element = std::pair<K, V>;
};
template <class T>
struct is_table : std::false_type {};
template <bool kUnion, class... E>
struct is_table<Entries<kUnion, E...>> : std::true_type {};

template <class C>
auto element_of() {
  if constexpr (is_map<C>::value) {
    return typename is_map<C>::element{};
  } else {
    return typename C::value_type{};
  }
}

template <class C, class E>
void add(C& items, E&& e) {
  if constexpr (is_map<C>::value) {
    items.insert_or_assign(std::move(e.first), std::move(e.second));
  } else {
    items.push_back(std::forward<E>(e));
  }
}

inline unsigned list_size(size_t n) {
  return static_cast<unsigned>(n);
}

struct ReadContext {
  const char* what;  // the message, for errors
  Status status;     // the first problem found
  void fail(Status s) {
    if (status.ok()) status = std::move(s);
  }
};

}  // namespace detail

template <class B, class... F, class M>
void write(B b, const Table<F...>& table, const M& m);
template <class B, class... A, class V>
void write(B b, const OneOf<A...>& table, const V& v);

template <class B, class F, class T>
void write_field(B b, const F& f, const T& v) {
  using Sub = std::decay_t<decltype(f.sub)>;
  constexpr bool kTable = detail::is_table<Sub>::value;
  if constexpr (kTable && (detail::is_vector<T>::value || detail::is_map<T>::value)) {
    auto list = f.init(b, detail::list_size(v.size()));
    unsigned i = 0;
    for (const auto& e : v) write(list[i++], f.sub, e);
  } else if constexpr (kTable) {
    write(f.init(b), f.sub, v);
  } else if constexpr (detail::is_vector<T>::value) {
    auto list = f.init(b, detail::list_size(v.size()));
    for (size_t i = 0; i < v.size(); ++i) list.set(static_cast<unsigned>(i), v[i]);
  } else if constexpr (std::is_enum_v<T>) {
    using Wire = decltype(f.get(b));
    f.set(b, static_cast<Wire>(static_cast<std::underlying_type_t<T>>(v)));
  } else if constexpr (std::is_same_v<decltype(f.get(b)), capnp::Data::Builder>) {
    f.set(b, capnp::Data::Reader(reinterpret_cast<const kj::byte*>(v.data()), v.size()));
  } else if constexpr (std::is_class_v<T> && !std::is_same_v<T, std::string>) {
    static_assert(std::is_empty_v<T>, "a struct field needs its table (TROUPE_CAPNP_STRUCT)");
    f.set(b);  // Void
  } else {
    f.set(b, v);
  }
}

template <class B, class... F, class M>
void write(B b, const Table<F...>& table, const M& m) {
  std::apply([&](const auto&... f) { (write_field(b, f, f.member(m)), ...); }, table.items);
}

template <class B, class... A, class V>
void write(B b, const OneOf<A...>& table, const V& v) {
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        auto one = [&](const auto& a) {
          if constexpr (std::is_same_v<typename std::decay_t<decltype(a)>::value_type, T>) {
            write_field(b, a.field, a.field.member(x));
          }
        };
        std::apply([&](const auto&... a) { (one(a), ...); }, table.items);
      },
      v);
}

template <class R, class... F, class M>
void read(R r, const Table<F...>& table, M& m, detail::ReadContext& cx);
template <class R, class... A, class V>
void read(R r, const OneOf<A...>& table, V& v, detail::ReadContext& cx);

template <class R, class F, class T>
void read_field(R r, const F& f, T& v, detail::ReadContext& cx) {
  using Sub = std::decay_t<decltype(f.sub)>;
  constexpr bool kTable = detail::is_table<Sub>::value;
  if constexpr (kTable && (detail::is_vector<T>::value || detail::is_map<T>::value)) {
    for (auto x : f.get(r)) {
      auto e = detail::element_of<T>();
      read(x, f.sub, e, cx);
      detail::add(v, std::move(e));
    }
  } else if constexpr (kTable) {
    read(f.get(r), f.sub, v, cx);
  } else if constexpr (detail::is_vector<T>::value) {
    for (auto x : f.get(r)) v.emplace_back(x);
  } else if constexpr (std::is_enum_v<T>) {
    const auto raw = static_cast<uint64_t>(f.get(r));
    if (raw > static_cast<uint64_t>(f.sub.last)) {
      cx.fail(data_loss("{}: unknown {} {} (at most {})", cx.what, f.name, raw,
                        static_cast<uint64_t>(f.sub.last)));
    } else {
      v = static_cast<T>(raw);
    }
  } else if constexpr (std::is_same_v<decltype(f.get(r)), capnp::Data::Reader>) {
    const capnp::Data::Reader d = f.get(r);
    v.assign(reinterpret_cast<const char*>(d.begin()), d.size());
  } else if constexpr (std::is_class_v<T> && !std::is_same_v<T, std::string>) {
    static_assert(std::is_empty_v<T>, "a struct field needs its table (TROUPE_CAPNP_STRUCT)");
  } else {
    v = f.get(r);
  }
}

template <class R, class... F, class M>
void read(R r, const Table<F...>& table, M& m, detail::ReadContext& cx) {
  std::apply([&](const auto&... f) { (read_field(r, f, f.member(m), cx), ...); }, table.items);
}

template <class R, class... A, class V>
void read(R r, const OneOf<A...>& table, V& v, detail::ReadContext& cx) {
  bool found = false;
  auto one = [&](const auto& a) {
    if (found || !a.field.is(r)) return;
    found = true;
    typename std::decay_t<decltype(a)>::value_type x{};
    read_field(r, a.field, a.field.member(x), cx);
    v = std::move(x);
  };
  std::apply([&](const auto&... a) { (one(a), ...); }, table.items);
  if (!found) cx.fail(data_loss("{}: unknown union member {}", cx.what, static_cast<int>(r.which())));
}

// Reads `m` out of `r` by `table`; the first problem found (an unknown enumerator or
// union member) names the message `what`.
template <class R, class Tbl, class M>
Status read_into(R r, const Tbl& table, M& m, const char* what) {
  detail::ReadContext cx{what, Status()};
  read(r, table, m, cx);
  return cx.status;
}

// A flat message of root struct `Root` holding `m`, copied by `table`.
template <class Root, class Tbl, class M>
std::string encode(const M& m, const Tbl& table) {
  capnp::MallocMessageBuilder mb;
  write(mb.initRoot<Root>(), table, m);
  return to_flat_bytes(mb);
}

// `bytes` read back (core/capnp_io.h's bounds) into an M by `table`, then `check(m)`: the
// codec's own checks of the decoded value (a Status).
template <class Root, class M, class Tbl, class Check>
Result<M> decode(std::string_view bytes, const char* what, const CapnpLimits& limits, const Tbl& table,
                 Check check) {
  return read_flat_message(bytes, what, limits, [&](capnp::MessageReader& reader) -> Result<M> {
    M m{};
    TROUPE_RETURN_IF_ERROR(read_into(reader.getRoot<Root>(), table, m, what));
    TROUPE_RETURN_IF_ERROR(check(m));
    return m;
  });
}

// The check of a message that the wire types already say all about.
inline constexpr auto kNoCheck = [](const auto&) { return Status(); };

}  // namespace troupe::capnp_codec

// Defines `std::string encode_<name>(const Type&)` and `Result<Type> decode_<name>(std::string_view)`
// for the C++ message Type whose root struct is the global Cap'n Proto ::Type, copied by
// `table`, decoded under `limits` and then `check` (capnp_codec::kNoCheck: none).
#define TROUPE_CAPNP_CODEC(name, Type, table, limits, check)                                \
  std::string encode_##name(const Type& m) {                                                \
    return ::troupe::capnp_codec::encode<::Type>(m, table);                                 \
  }                                                                                         \
  Result<Type> decode_##name(std::string_view bytes) {                                      \
    return ::troupe::capnp_codec::decode<::Type, Type>(bytes, #Type, limits, table, check); \
  }
