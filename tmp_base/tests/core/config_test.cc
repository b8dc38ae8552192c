// tests/core/config_test.cc — strict TOML config reading.
#include "core/config.h"

#include <gtest/gtest.h>

namespace troupe {
namespace {

TEST(Config, TypedReadsAndDefaults) {
  auto c = ConfigTable::parse_string("[model]\nd_model = 64\nname = \"tiny\"\nlr = 3e-4\n", "t.toml");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(*c->get_int("model.d_model"), 64);
  EXPECT_EQ(*c->get_string("model.name"), "tiny");
  EXPECT_DOUBLE_EQ(*c->get_double("model.lr"), 3e-4);
  EXPECT_EQ(*c->get_int("model.n_layers", 2), 2);
  EXPECT_TRUE(c->check_all_keys_used().ok());
}

TEST(Config, ErrorsNameTheKey) {
  auto c = ConfigTable::parse_string("[model]\nd_model = \"big\"\nn_layr = 3\n", "t.toml");
  ASSERT_TRUE(c.ok());
  auto d = c->get_int("model.d_model");
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("model.d_model"), std::string::npos);
  auto missing = c->get_int("model.vocab");
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
  EXPECT_EQ(*c->get_int("model.d_model"), 128);
  EXPECT_EQ(*c->get_string("train.run_dir"), "runs/x");
  EXPECT_FALSE(c->set_from_string("novalue").ok());
}

TEST(Config, MissingFile) {
  auto c = ConfigTable::parse_file("/nonexistent/x.toml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("/nonexistent/x.toml"), std::string::npos);
}

}  // namespace
}  // namespace troupe
