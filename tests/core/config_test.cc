// tests/core/config_test.cc — strict TOML config reading.
#include "core/config.h"

#include <gtest/gtest.h>

namespace troupe {
namespace {

TEST(Config, TypedReadsAndDefaults) {
  auto c = ConfigTable::parse_string("[model]\nd_model = 64\nname = \"tiny\"\nlr = 3e-4\n", "t.toml");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(*c->get_int("model.d_model", std::nullopt, "a key"), 64);
  EXPECT_EQ(*c->get_string("model.name", std::nullopt, "a key"), "tiny");
  EXPECT_DOUBLE_EQ(*c->get_double("model.lr", std::nullopt, "a key"), 3e-4);
  EXPECT_EQ(*c->get_int("model.n_layers", 2, "a key"), 2);
  EXPECT_TRUE(c->check_all_keys_used().ok());
}

TEST(Config, ErrorsNameTheKey) {
  auto c = ConfigTable::parse_string("[model]\nd_model = \"big\"\nn_layr = 3\n", "t.toml");
  ASSERT_TRUE(c.ok());
  auto d = c->get_int("model.d_model", std::nullopt, "a key");
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("model.d_model"), std::string::npos);
  auto missing = c->get_int("model.vocab", std::nullopt, "a key");
  EXPECT_NE(missing.status().message().find("missing required key 'model.vocab'"), std::string::npos);
  Status unknown = c->check_all_keys_used();
  EXPECT_NE(unknown.message().find("model.n_layr"), std::string::npos) << unknown.to_string();
}

TEST(Config, ParseErrorNamesLine) {
  auto c = ConfigTable::parse_string("[model]\nd_model = = 3\n", "bad.toml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("bad.toml:2"), std::string::npos) << c.status().to_string();
}

TEST(Config, Overrides) {
  auto c = ConfigTable::parse_string("[model]\nd_model = 64\n");
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c->set_from_string("model.d_model=128").ok());
  ASSERT_TRUE(c->set_from_string("train.run_dir=runs/x").ok());
  EXPECT_EQ(*c->get_int("model.d_model", std::nullopt, "a key"), 128);
  EXPECT_EQ(*c->get_string("train.run_dir", std::nullopt, "a key"), "runs/x");
  EXPECT_FALSE(c->set_from_string("novalue").ok());
}

// Every read declares the key: its type, its default as TOML writes it (or the text the
// reader shows for a derived one) and its description, in the order of first read; a
// second read of the same key does not declare it again.
TEST(Config, ReadsDeclareTheirKeys) {
  auto c = ConfigTable::parse_string("[a]\nx = 3\n");
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c->get_int("a.x", 1, "the x").ok());
  ASSERT_TRUE(c->get_double("a.y", 0.5, "the y", "a.x / 2").ok());
  ASSERT_TRUE(c->get_bool("a.z", true, "the z").ok());
  ASSERT_TRUE(c->get_string("b.s", "hi", "the s").ok());
  ASSERT_TRUE(c->get_int_list("b.l", std::vector<int64_t>{1, 2}, "the l").ok());
  ASSERT_FALSE(c->get_int("b.req", std::nullopt, "required").ok());
  ASSERT_TRUE(c->get_int("a.x", 9, "again").ok());
  const auto& d = c->documented_keys();
  ASSERT_EQ(d.size(), 6u);
  EXPECT_EQ(d[0].key, "a.x");
  EXPECT_EQ(d[0].type, "integer");
  EXPECT_EQ(d[0].default_text, "1");
  EXPECT_EQ(d[0].description, "the x");
  EXPECT_EQ(d[1].default_text, "a.x / 2");
  EXPECT_EQ(d[2].default_text, "true");
  EXPECT_EQ(d[3].default_text, "\"hi\"");
  EXPECT_EQ(d[4].type, "list of integers");
  EXPECT_EQ(d[4].default_text, "[1, 2]");
  EXPECT_EQ(d[5].default_text, "(required)");
  EXPECT_EQ(c->keys_under("a"), std::vector<std::string>{"a.x"});
  EXPECT_TRUE(c->keys_under("nothing").empty());
}

TEST(Config, MissingFile) {
  auto c = ConfigTable::parse_file("/nonexistent/x.toml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("/nonexistent/x.toml"), std::string::npos);
}

}  // namespace
}  // namespace troupe
