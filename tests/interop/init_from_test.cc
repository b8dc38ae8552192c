// tests/interop/init_from_test.cc — train_moe with Hugging Face checkpoints, as a user
// runs it (the binary, real worker processes, Gloo): `--init-from` the directories
// transformers wrote gives transformers' loss on the first step in several layouts (every
// rank reading its own slices), and a model trained in one layout, exported with
// `train_moe export`, imports into another layout with every parameter bitwise equal.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "checkpoint/reader.h"
#include "data/token_data.h"
#include "data/tokenizer.h"
#include "interop_test_util.h"
#include "tests/common/train_moe_harness.h"

namespace troupe::test {
namespace {

// A data directory whose train and val splits are exactly row 0 of the family's fixture
// tokens (17 tokens: every window of 16 + 1 is that row), with a tokenizer that fits the
// fixture's vocabulary of 320.
fs::path make_data(const fs::path& root, const std::string& family) {
  const fs::path dir = root / ("data-" + family);
  fs::create_directories(dir);
  layers::BpeTrainer tr;
  for (int i = 0; i < 50; ++i)
    tr.add_text("the quick brown fox " + std::to_string(i) + " jumps over the lazy dog\n");
  auto tok = tr.train(300);
  EXPECT_TRUE(tok.ok());
  EXPECT_TRUE(tok->save((dir / "tokenizer.json").string()).ok());
  const nlohmann::json ref = read_json_file(fixture(family) + "/reference.json");
  const std::vector<int32_t> row = ref["tokens"][0].get<std::vector<int32_t>>();
  for (const char* split : {"train", "val"}) {
    layers::ShardWriter w(dir.string(), split, 2, 1 << 20);
    EXPECT_TRUE(w.append(row).ok());
    EXPECT_TRUE(w.finish().ok());
  }
  return dir;
}

fs::path write_config(const fs::path& root, const fs::path& data) {
  const fs::path p = root / "hf.toml";
  write_text(p.string(),
             "[train]\nseed = 7\nsteps = 1\nseq_len = 16\nmicro_batch_size = 2\neval_every = 0\n"
             "eval_batches = 1\nlog_every = 1\n[optim]\nlr = 1e-3\nmin_lr = 0.0\n[data]\ndir = \"" +
                 data.string() + "\"\n");
  return p;
}

RunResult train(const fs::path& config, const fs::path& run_dir, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {train_moe_bin(), "--config", config.string(), "--run-dir",
                                   run_dir.string()};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return run(argv, run_dir.string() + ".log", std::chrono::seconds(120));
}

class InitFrom : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { root_ = new fs::path(make_run_root("hf-init-from")); }
  static void TearDownTestSuite() {
    remove_run_root(*root_);
    delete root_;
  }
  static fs::path* root_;
};
fs::path* InitFrom::root_ = nullptr;

TEST_F(InitFrom, FirstStepLossIsTransformersInEveryLayout) {
  struct Case {
    std::string family, layout;
  };
  // Mixtral: 4 heads / 2 kv heads / 4 experts over n = 2; Qwen3-MoE's 4 blocks (dense,
  // MoE, dense, MoE) over 2 stages too.
  const std::vector<Case> cases = {
      {"mixtral", ""}, {"mixtral", "n=2"}, {"qwen3_moe", ""}, {"qwen3_moe", "pp=2,n=2"}};
  std::map<std::string, double> second_step;  // family -> the one-process run's step-2 loss
  for (const Case& c : cases) {
    const fs::path data = make_data(*root_ / c.family, c.family);
    const fs::path cfg = write_config(*root_ / c.family, data);
    const fs::path run_dir = *root_ / c.family / ("run" + (c.layout.empty() ? "" : "-" + c.layout));
    std::vector<std::string> extra = {"--init-from", fixture(c.family), "--set", "train.steps=2"};
    if (!c.layout.empty()) extra.insert(extra.end(), {"--parallel", c.layout});
    const RunResult r = train(cfg, run_dir, extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // Every rank read its slices of the files (and only they hold the weights now).
    EXPECT_NE(r.output.find("rank 0: initialised from"), std::string::npos) << r.output;
    const auto steps = step_records(run_dir / "metrics.jsonl");
    ASSERT_FALSE(steps.empty()) << r.output;
    const double loss = steps.front().at("lm_loss").get<double>();
    const double want = read_json_file(fixture(c.family) + "/reference.json").at("loss_row0").get<double>();
    fmt::print("[{} {}] first-step loss {:.7f}, transformers {:.7f}, relative difference {:.1e}\n", c.family,
               c.layout.empty() ? "pp=1,dp=1,n=1" : c.layout, loss, want, rel_diff(want, loss));
    EXPECT_LT(rel_diff(want, loss), 1e-4) << c.family << " " << c.layout;
    // The second step follows the first's gradients (the q/k norm's, the Ulysses
    // shards' and the stages' too): every layout takes the one-process run's step.
    ASSERT_EQ(steps.size(), 2u);
    const double loss2 = steps[1].at("lm_loss").get<double>();
    if (c.layout.empty()) {
      second_step[c.family] = loss2;
    } else {
      EXPECT_LT(rel_diff(second_step.at(c.family), loss2), 1e-5) << c.family << " " << c.layout;
      fmt::print("[{} {}] second-step loss {:.7f}, one process {:.7f}\n", c.family, c.layout, loss2,
                 second_step.at(c.family));
    }
  }
}

TEST_F(InitFrom, ExportThenImportInAnotherLayoutKeepsEveryParameterBitwise) {
  // Trained from the fixture in one layout, exported (f32), imported in another: after a
  // step whose learning rate (1e-30) moves no f32 value, the second run's checkpoint holds
  // the first's parameters bit for bit.
  struct Case {
    std::string family, layout_a, layout_b;
  };
  for (const Case& c : std::vector<Case>{{"mixtral", "pp=2", "n=2"}, {"qwen3_moe", "n=2", "pp=2"}}) {
    const fs::path dir = *root_ / ("roundtrip-" + c.family);
    const fs::path data = make_data(dir, c.family);
    const fs::path cfg = write_config(dir, data);
    const RunResult a = train(cfg, dir / "a",
                              {"--init-from", fixture(c.family), "--parallel", c.layout_a, "--set",
                               "train.steps=2", "--set", "checkpoint.every=2"});
    ASSERT_EQ(a.exit_code, 0) << a.output;
    const RunResult ex = run({train_moe_bin(), "export", "--run", (dir / "a").string(), "--format", "hf",
                              "--family", c.family, "--dtype", "f32", "--out", (dir / "hf").string()},
                             dir / "export.log", std::chrono::seconds(60));
    ASSERT_EQ(ex.exit_code, 0) << ex.output;
    const RunResult b = train(cfg, dir / "b",
                              {"--init-from", (dir / "hf").string(), "--parallel", c.layout_b, "--set",
                               "optim.lr=1e-30", "--set", "checkpoint.every=1"});
    ASSERT_EQ(b.exit_code, 0) << b.output;
    auto ra = checkpoint::CheckpointReader::open_latest_valid((dir / "a/checkpoints").string());
    auto rb = checkpoint::CheckpointReader::open_latest_valid((dir / "b/checkpoints").string());
    ASSERT_TRUE(ra.ok() && rb.ok());
    EXPECT_NE((*ra)->layout(), (*rb)->layout());
    int compared = 0;
    for (const auto& [name, rec] : (*ra)->manifest().tensors) {
      if (name.rfind("opt.", 0) == 0 || name.ends_with(".router.bias")) continue;  // parameters only
      auto x = (*ra)->read_full(name);
      auto y = (*rb)->read_full(name);
      ASSERT_TRUE(x.ok() && y.ok()) << name;
      ASSERT_EQ(x->nbytes(), y->nbytes()) << name;
      EXPECT_EQ(std::memcmp(x->data_ptr(), y->data_ptr(), x->nbytes()), 0) << c.family << ": " << name;
      ++compared;
    }
    fmt::print("[{}] {} parameters trained in {}, exported and imported in {}: bitwise equal\n", c.family,
               compared, c.layout_a, c.layout_b);
    EXPECT_GT(compared, 10);
  }
}

TEST_F(InitFrom, RefusesConflictsAndResumeTogether) {
  const fs::path dir = *root_ / "refuse";
  const fs::path data = make_data(dir, "mixtral");
  const fs::path cfg = write_config(dir, data);
  const RunResult conflict =
      train(cfg, dir / "c", {"--init-from", fixture("mixtral"), "--set", "model.d_model=128"});
  EXPECT_NE(conflict.exit_code, 0);
  EXPECT_NE(conflict.output.find("conflicts with --init-from"), std::string::npos) << conflict.output;
  const RunResult both =
      train(cfg, dir / "d", {"--init-from", fixture("mixtral"), "--resume", (dir / "c").string()});
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.output.find("--resume"), std::string::npos) << both.output;
  const RunResult missing = train(cfg, dir / "e", {"--init-from", (dir / "nope").string()});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("not a directory"), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace troupe::test
