// tests/core/env_test.cc — the one environment reader (core/env.h): typed reads whose
// errors name the variable and its value.
#include "core/env.h"

#include <gtest/gtest.h>
#include <stdlib.h>

namespace troupe {
namespace {

constexpr const char* kVar = "TROUPE_ENV_TEST_VALUE";

class Env : public ::testing::Test {
 protected:
  void TearDown() override { ::unsetenv(kVar); }
  static void set(const char* v) { ::setenv(kVar, v, 1); }
};

TEST_F(Env, UnsetAndEmptyAreTheFallback) {
  ::unsetenv(kVar);
  EXPECT_FALSE(env::get(kVar).has_value());
  EXPECT_EQ(env::get_or(kVar, "x"), "x");
  EXPECT_EQ(*env::get_int(kVar, 7), 7);
  EXPECT_TRUE(*env::get_bool(kVar, true));
  set("");
  EXPECT_FALSE(env::get(kVar).has_value());
  EXPECT_EQ(*env::get_int(kVar, -3), -3);
}

TEST_F(Env, IntegersAreReadWhole) {
  set("42");
  EXPECT_EQ(*env::get_int(kVar, 0), 42);
  set("-1");
  EXPECT_EQ(*env::get_int(kVar, 0), -1);
  for (const char* bad : {"4x", "x", " 4", "4.5", "99999999999999999999"}) {
    set(bad);
    Result<int64_t> r = env::get_int(kVar, 0);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find(kVar), std::string::npos) << r.status().to_string();
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().to_string();
  }
  set("5");
  Result<int64_t> out = env::get_int(kVar, 0, 0, 4);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("out of range [0, 4]"), std::string::npos)
      << out.status().to_string();
}

TEST_F(Env, Booleans) {
  for (const char* t : {"1", "true", "yes", "on"}) {
    set(t);
    EXPECT_TRUE(*env::get_bool(kVar, false)) << t;
  }
  for (const char* f : {"0", "false", "no", "off"}) {
    set(f);
    EXPECT_FALSE(*env::get_bool(kVar, true)) << f;
  }
  set("maybe");
  Result<bool> r = env::get_bool(kVar, false);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("TROUPE_ENV_TEST_VALUE='maybe'"), std::string::npos)
      << r.status().to_string();
}

}  // namespace
}  // namespace troupe
