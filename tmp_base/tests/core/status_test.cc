// tests/core/status_test.cc — Status, Result and the propagation macros.
#include "core/status.h"

#include <gtest/gtest.h>

#include "core/check.h"

namespace troupe {
namespace {

Result<int> parse_positive(int v) {
  if (v <= 0) return invalid_argument("value {} is not positive", v);
  return v;
}

Result<int> doubled(int v) {
  TROUPE_ASSIGN_OR_RETURN(int x, parse_positive(v));
  return 2 * x;
}

Status check_both(int a, int b) {
  TROUPE_RETURN_IF_ERROR(parse_positive(a).status());
  TROUPE_RETURN_IF_ERROR(parse_positive(b).status());
  return ok_status();
}

TEST(Status, OkAndError) {
  EXPECT_TRUE(ok_status().ok());
  Status s = not_found("job {} unknown", 7);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.to_string(), "NotFound: job 7 unknown");
  EXPECT_EQ(s.with_context("cancel").to_string(), "NotFound: cancel: job 7 unknown");
}

TEST(Result, ValueAndPropagation) {
  EXPECT_EQ(*doubled(4), 8);
  auto bad = doubled(-1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.value_or(5), 5);
  EXPECT_TRUE(check_both(1, 2).ok());
  EXPECT_EQ(check_both(1, 0).message(), "value 0 is not positive");
}

TEST(ResultDeathTest, ValueOfErrorAborts) {
  auto bad = parse_positive(0);
  EXPECT_DEATH((void)bad.value(), "Result holding an error");
}

TEST(CheckDeathTest, NamesConditionAndValues) {
  int a = 3, b = 4;
  EXPECT_DEATH(TROUPE_CHECK_EQ(a, b, "sizes differ"), "a == b.*3 vs 4.*sizes differ");
}

}  // namespace
}  // namespace troupe
