// tests/training/run_config_test.cc — TrainConfig parsing: the shipped configs, unknown
// keys and bad values named in the error, layout validation, overrides.
#include "training/run_config.h"

#include <gtest/gtest.h>

namespace troupe::layers {
namespace {

const std::string kConfigs = std::string(TROUPE_SOURCE_DIR) + "/apps/configs/";

Result<TrainConfig> parse(const std::string& text) {
  auto c = ConfigTable::parse_string(text, "test.toml");
  if (!c.ok()) return c.status();
  return parse_train_config(*c);
}

TEST(TrainConfig, TinyParses) {
  auto tc = load_train_config(kConfigs + "tiny.toml", {});
  ASSERT_TRUE(tc.ok()) << tc.status().to_string();
  EXPECT_EQ(tc->model.n_layers, 4);
  EXPECT_FALSE(tc->model.is_moe_block(0));
  EXPECT_TRUE(tc->model.is_moe_block(1));
  EXPECT_TRUE(tc->model.is_moe_block(3));
  EXPECT_EQ(tc->parallel.world(), 1);
  EXPECT_EQ(tc->train.expert_grads, DType::kF32);  // the default
  EXPECT_FALSE(tc->train.split_master);            // "f32", the default
  // The layouts of the distributed equivalence tests fit the tiny model.
  for (auto [pp, dp, n] : {std::tuple{2, 1, 1}, {1, 2, 1}, {1, 1, 2}, {1, 1, 4}, {2, 1, 2}, {1, 2, 2}}) {
    ParallelOptions p{pp, dp, n};
    EXPECT_TRUE(p.validate(tc->model).ok()) << pp << dp << n;
    EXPECT_EQ(p.layout().value(), ParallelLayout::make(pp, dp, n).value());
  }
}

TEST(TrainConfig, Bench1bIsTheOneBillionParameterBenchmarkModel) {
  auto tc = load_train_config(kConfigs + "bench_1b.toml", {});
  ASSERT_TRUE(tc.ok()) << tc.status().to_string();
  const ModelConfig& m = tc->model;
  EXPECT_EQ(m.d_model, 1024);
  EXPECT_EQ(m.n_layers, 12);
  EXPECT_EQ(m.n_heads, 16);
  EXPECT_EQ(m.moe.num_experts, 16);
  EXPECT_EQ(m.moe.top_k, 2);
  EXPECT_EQ(m.moe.expert_hidden, 2048);
  EXPECT_EQ(m.vocab_size, 32768);
  EXPECT_FALSE(m.tie_embeddings);
  EXPECT_EQ(tc->train.seq_len, 2048);
  EXPECT_EQ(tc->train.micro_batch_size, 8);
  EXPECT_DOUBLE_EQ(tc->optim.grad_clip, 1.0);
  EXPECT_EQ(tc->train.expert_grads, DType::kBF16);  // as the PyTorch peer's (autocast)
  EXPECT_TRUE(tc->train.split_master);              // the same f32 masters, in two halves
  for (int64_t i = 0; i < 12; ++i) EXPECT_TRUE(m.is_moe_block(i));
  EXPECT_NEAR(static_cast<double>(m.num_params()) / 1e9, 1.33, 0.005);
  EXPECT_NEAR(static_cast<double>(m.num_active_params()) / 1e6, 235, 1.0);
  const double flops = 6.0 * static_cast<double>(m.num_active_params()) + 6.0 * 12 * 2048 * 1024;
  EXPECT_NEAR(flops / 1e9, 1.561, 0.002);
}

TEST(TrainConfig, GlobalBatchIsTheSameInEveryLayout) {
  // One config, three layouts: the batch of a step stays 16 sequences; the micro-batches
  // per replica follow from dp.
  for (const auto& [parallel, micro] : std::vector<std::pair<std::string, int64_t>>{
           {"parallel.dp=1", 4}, {"parallel.dp=2", 2}, {"parallel.dp=4", 1}}) {
    auto tc = load_train_config(kConfigs + "tiny.toml",
                                {"train.global_batch=16", "train.micro_batch_size=4", parallel});
    ASSERT_TRUE(tc.ok()) << tc.status().to_string();
    EXPECT_EQ(tc->global_batch(), 16) << parallel;
    EXPECT_EQ(tc->train.grad_accum, micro) << parallel;
    EXPECT_EQ(tc->tokens_per_step(), 16 * tc->train.seq_len) << parallel;
  }
  // Without the key: one micro-batch at 1x1x1.
  auto dflt = parse("[train]\nmicro_batch_size = 3\n");
  ASSERT_TRUE(dflt.ok()) << dflt.status().to_string();
  EXPECT_EQ(dflt->global_batch(), 3);
  EXPECT_EQ(dflt->train.grad_accum, 1);
  TrainOptions t;
  t.global_batch = 12;
  t.micro_batch_size = 2;
  EXPECT_EQ(micro_batches_per_replica(t, 3).value(), 2);
  EXPECT_FALSE(micro_batches_per_replica(t, 4).ok());
}

TEST(TrainConfig, UnknownKeyIsNamed) {
  auto tc = parse("[model]\nd_model = 64\nn_layr = 3\n");
  ASSERT_FALSE(tc.ok());
  EXPECT_NE(tc.status().message().find("model.n_layr"), std::string::npos) << tc.status().to_string();
  auto tc2 = parse("[trian]\nsteps = 3\n");
  ASSERT_FALSE(tc2.ok());
  EXPECT_NE(tc2.status().message().find("trian.steps"), std::string::npos);
}

TEST(TrainConfig, BadValuesAreNamed) {
  struct Case {
    const char* text;
    const char* key;
  };
  const Case cases[] = {
      {"[model]\nd_model = \"big\"\n", "model.d_model"},
      {"[model]\nd_model = 100\nn_heads = 3\n", "model.n_heads"},
      {"[model.moe]\nrouter = \"argmax\"\n", "model.moe.router"},
      {"[model.moe]\ntop_k = 9\nnum_experts = 8\n", "model.moe.top_k"},
      {"[train]\nsteps = 0\n", "train.steps"},
      {"[optim]\nlr = -1.0\n", "optim.lr"},
      {"[model]\nmoe_layers = [0, 7]\nn_layers = 4\n", "model.moe_layers"},
      {"[parallel]\nn = 3\n", "parallel.n"},
      {"[parallel]\npp = 3\n", "parallel.pp"},
      {"[parallel]\ndp = 0\n", "[parallel]: parallel layout pp=1,dp=0,n=1: dp must be >= 1, got 0"},
      {"[elastic]\ngpu_state = \"memory\"\n", "elastic.snapshot_every"},
      {"[elastic]\nreplica_every = 5\n", "'elastic.replica_every' is gone"},
      {"[elastic]\nsnapshot_every = -1\n", "elastic.snapshot_every"},
      {"[elastic]\nstraggler_policy = \"kill\"\n", "elastic.straggler_policy"},
      {"[train]\nexpert_grads = \"fp16\"\n", "train.expert_grads"},
      {"[train]\nglobal_batch = 16\nexpert_grads = \"bf16\"\n", "needs one micro-batch per step"},
      {"[train]\ngrad_accum = 2\n",
       "key 'train.grad_accum' is no longer read: state the batch of a step as "
       "train.global_batch"},
      {"[train]\nglobal_batch = 12\n",
       "train.global_batch = 12 sequences cannot be split over dp = 1 replicas "
       "of micro-batches of train.micro_batch_size = 8"},
      {"[train]\nglobal_batch = 8\n[parallel]\ndp = 2\n", "(8 is not a multiple of 8 x 2 = 16)"},
      {"[train]\nmaster_weights = \"bf16\"\n", "train.master_weights"},
      {"[parallel]\ndispatch = \"allgather\"\ndevice_dispatch = true\n",
       "parallel.device_dispatch needs parallel.dispatch = \"alltoall\""},
  };
  for (const auto& c : cases) {
    auto tc = parse(c.text);
    ASSERT_FALSE(tc.ok()) << c.text;
    EXPECT_NE(tc.status().message().find(c.key), std::string::npos) << tc.status().to_string();
  }
}

// parallel.device_dispatch is on by default where it can work, so the all-gather dispatch
// leaves it off without an error; set true it is required.
TEST(TrainConfig, DeviceDispatchDefaultsOnAndIsRequiredWhenSet) {
  auto dflt = parse("[parallel]\nn = 2\n");
  ASSERT_TRUE(dflt.ok()) << dflt.status().to_string();
  EXPECT_TRUE(dflt->parallel.device_dispatch);
  EXPECT_FALSE(dflt->parallel.device_dispatch_required);
  auto gather = parse("[parallel]\nn = 2\ndispatch = \"allgather\"\n");
  ASSERT_TRUE(gather.ok()) << gather.status().to_string();
  auto set = parse("[parallel]\nn = 2\ndevice_dispatch = true\n");
  ASSERT_TRUE(set.ok()) << set.status().to_string();
  EXPECT_TRUE(set->parallel.device_dispatch_required);
  auto off = parse("[parallel]\nn = 2\ndevice_dispatch = false\n");
  ASSERT_TRUE(off.ok()) << off.status().to_string();
  EXPECT_FALSE(off->parallel.device_dispatch);
  EXPECT_FALSE(off->parallel.device_dispatch_required);
}

TEST(TrainConfig, OverridesApplyAndAreChecked) {
  auto tc = load_train_config(kConfigs + "tiny.toml", {"train.steps=7", "model.moe.router=sigmoid"});
  ASSERT_TRUE(tc.ok()) << tc.status().to_string();
  EXPECT_EQ(tc->train.steps, 7);
  EXPECT_EQ(tc->model.moe.score, kernels::RouterScore::kSigmoid);
  auto bad = load_train_config(kConfigs + "tiny.toml", {"train.stepz=7"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("train.stepz"), std::string::npos);
  auto missing = load_train_config(kConfigs + "no_such.toml", {});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

// The [bench] and [test] sections (switches for comparison, fault injection) are read only
// when the caller admits them; their keys' old names say where they went.
TEST(TrainConfig, BenchAndTestSectionsAreFenced) {
  auto refused =
      load_train_config(kConfigs + "tiny.toml", {"bench.overlap_a2a=false", "test.inject=\"kill@2:any:0\""});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                "sets 'bench.overlap_a2a', 'test.inject' of the [bench]/[test] sections"),
            std::string::npos)
      << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("--allow-test-config"), std::string::npos);
  auto admitted =
      load_train_config(kConfigs + "tiny.toml",
                        {"bench.overlap_a2a=false", "bench.cuda_graph=false", "test.inject=\"kill@2:any:0\""},
                        TestSections::kAdmit);
  ASSERT_TRUE(admitted.ok()) << admitted.status().to_string();
  EXPECT_FALSE(admitted->parallel.overlap_a2a);
  EXPECT_FALSE(admitted->train.cuda_graph);
  EXPECT_TRUE(admitted->train.cuda_graph_asked);
  EXPECT_EQ(admitted->elastic.inject, "kill@2:any:0");
  EXPECT_EQ(admitted->test_keys.size(), 3u);
  auto plain = load_train_config(kConfigs + "tiny.toml", {});
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->parallel.overlap_a2a);
  EXPECT_FALSE(plain->train.cuda_graph_asked);
  EXPECT_TRUE(plain->test_keys.empty());
  for (const auto& [old_key, new_key] :
       std::vector<std::pair<std::string, std::string>>{{"parallel.overlap_a2a", "bench.overlap_a2a"},
                                                        {"train.cuda_graph", "bench.cuda_graph"},
                                                        {"elastic.inject", "test.inject"}}) {
    auto moved = load_train_config(kConfigs + "tiny.toml", {old_key + "=false"}, TestSections::kAdmit);
    ASSERT_FALSE(moved.ok()) << old_key;
    EXPECT_NE(moved.status().message().find("key '" + old_key + "' is now '" + new_key + "'"),
              std::string::npos)
        << moved.status().to_string();
  }
  auto unknown =
      load_train_config(kConfigs + "tiny.toml", {"bench.no_such_switch=true"}, TestSections::kAdmit);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("bench.no_such_switch"), std::string::npos);
}

TEST(LrSchedule, WarmupThenCosine) {
  LrSchedule s{1.0, 0.1, 10, 110};
  EXPECT_DOUBLE_EQ(s.at(1), 0.1);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  EXPECT_NEAR(s.at(500), 0.1, 1e-12);
  EXPECT_DOUBLE_EQ(clip_factor(2.0, 1.0), 0.5);
  EXPECT_DOUBLE_EQ(clip_factor(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_factor(5.0, 0.0), 1.0);
}

}  // namespace
}  // namespace troupe::layers
